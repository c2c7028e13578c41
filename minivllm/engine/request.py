"""Old import path of :mod:`minivllm.request` (``Request`` now sits above core and engine,
as vLLM v1's ``vllm/v1/request.py``); kept for the labs that import it from here."""

from minivllm.request import Request, RequestStatus, ScoreState  # noqa: F401
