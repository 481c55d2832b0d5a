"""The docker backend (``backend.py``), the daemon client every docker caller goes through
(``dockerd.py``), the guest's stdio over a hijacked exec stream (``stream.py``), the offline
image builder (``images.py``) and its host checks (``probe.py``)."""
