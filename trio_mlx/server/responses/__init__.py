"""OpenAI's Responses API: `POST /v1/responses`, stateless.

`_protocol.py` holds the request model and its translation into the engine's
chat messages, tools and response format; `_serving.py` the call, the
`response` object and the streamed events. The endpoint plugs into the
completion machinery through `server/_wire.py`; its errors have OpenAI's shape.
"""

from ._serving import RESPONSES_PATH as RESPONSES_PATH
from ._serving import ResponsesAPI as ResponsesAPI
