"""The bubblewrap backend (``backend.py``): what only it uses lives beside it, the seccomp
filter (``seccomp.py``), the host uid allocator (``uids.py``) and its host checks
(``probe.py``); cgroups and loop disks, which docker uses too, are one floor up."""
