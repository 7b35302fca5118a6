"""Bad input, generated and by hand, against a server process: never a 5xx, never a hang, always
OpenAI's error shape.

- schemathesis generates requests (valid and invalid) from the server's own /openapi.json;
- hypothesis fuzzes the request models in-process (any JSON in: a 400 naming its parameter, or
  options the engine's own checks accept or refuse with InvalidRequestError) and over HTTP;
- explicit cases: huge bodies, invalid UTF-8, wrong content types, deep nesting, absurd numbers.

The server serves a copy of the tiny model with a 48-token context, so that whatever the fuzzers
ask for stays cheap to generate. Its log must hold no ERROR and no traceback at the end.

Here the request models in process; against a server process: tests/system/test_fuzz.py.
"""

from __future__ import annotations

import os
from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from trio_mlx._errors import InvalidRequestError
from trio_mlx.actor import ActorInfo
from trio_mlx.engine._options import check_options
from trio_mlx.server._http import error_from_exception
from trio_mlx.server.openai._protocol import ChatCompletionRequest, CompletionRequest

CONTEXT = 48
MAX_N = 2
# Examples per fuzz test: CI keeps it at 100; set the variable for a long run.
EXAMPLES = int(os.environ.get("TRIO_MLX_FUZZ_EXAMPLES", "100"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TRIED: Counter[str] = Counter()  # cases tried (tests/system/test_fuzz.py prints its own)


# ---- hypothesis: the request models, in-process ------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)
FIELDS = sorted(set(ChatCompletionRequest.model_fields) | set(CompletionRequest.model_fields))
# Values near the edges of what each option takes, and plain wrong types.
edgy = st.one_of(
    json_values,
    st.sampled_from([0, -1, 1, 2, 20, 21, 47, 48, 49, 10**9, 10**12, 2**31, 2**63, 2**64, -(2**63), 1e308, -0.0,
                     0.5, 100.5, "", "x", [], {}, [0], ["a"], [[1, 2]], {"1": 5}, {"abc": 1}, {"-1": 1},
                     {"5": 1e9}, [{"role": "user", "content": "hi"}], [{"role": "user"}],
                     [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                     [{"role": "user", "content": [{"type": "image_url"}]}], {"include_usage": True}]),
)
fields = st.dictionaries(st.sampled_from(FIELDS), edgy, max_size=8)
BASES = ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}, {"prompt": "hi", "max_tokens": 3})
# Arbitrary objects (mostly refused early), and valid requests with a few fields changed (which get
# as far as the engine's own checks, or through them).
request_objects = fields | st.builds(lambda base, changed: {**base, **changed}, st.sampled_from(BASES), fields)
INFO = ActorInfo("llama", CONTEXT, 512, 0, "cpu", 0.0)


@settings(FUZZ, max_examples=4 * EXAMPLES)  # in-process: cheap
@given(obj=request_objects, chat=st.booleans())
def test_request_models_refuse_bad_input_with_a_400_naming_it(obj, chat):
    """Any JSON object either validates, or becomes a 400 naming its parameter; a validated one
    is then accepted or refused by the engine's own checks with InvalidRequestError, nothing else."""
    model = ChatCompletionRequest if chat else CompletionRequest
    TRIED["models in-process"] += 1
    try:
        req = model.model_validate(obj)
        req.check(MAX_N)
    except ValidationError as exc:
        error = error_from_exception(exc)
        assert error.status == 400 and error.code == "invalid_value" and error.message
        return
    except Exception as exc:  # the checks after validation raise HTTPError only
        error = error_from_exception(exc)
        assert error.status == 400, exc
        return
    try:
        check_options(req.to_options(), {}, INFO.vocab_size)
    except InvalidRequestError as exc:
        assert exc.message and error_from_exception(exc).status == 400
