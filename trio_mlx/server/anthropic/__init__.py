"""Anthropic's Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`.

`_protocol.py` holds the request models, their translation into the engine's
OpenAI-shaped chat and Anthropic's error body; `_serving.py` the calls, the
response and the streamed events. Both endpoints plug into the completion
machinery through `server/_wire.py`.
"""

from ._serving import COUNT_TOKENS_PATH as COUNT_TOKENS_PATH
from ._serving import MESSAGES_PATH as MESSAGES_PATH
from ._serving import CountTokensAPI as CountTokensAPI
from ._serving import MessagesAPI as MessagesAPI
