"""OpenAI's Chat Completions and Completions APIs: request models (`_protocol.py`),
responses and streamed chunks (`_serving.py`)."""
