"""Model files: resolve a reference to an MLX model directory, convert the embedded default,
build random-weight test models, and load a model or its tokenizer.

With `actor/`, the only package that imports MLX; the engine imports it lazily
(when it loads a tokenizer), the actor when it loads the weights.
"""
# ruff: noqa: E402

from . import _cpu_blas, _mlx_env

_cpu_blas.install()  # before anything imports mlx.core: it must bind to OpenBLAS first
_mlx_env.install()  # MLX's settings read from the environment, before MLX reads them
cpu_blas_status = _cpu_blas.status  # which BLAS runs MLX's CPU matmuls, in words

from ._cpu_blas import BlasStatus as BlasStatus
from ._lora import AdapterRows as AdapterRows
from ._models import CHATML_TEMPLATE as CHATML_TEMPLATE
from ._models import EMBEDDED_DEFAULT as EMBEDDED_DEFAULT
from ._models import adapter_rows as adapter_rows
from ._models import check_adapter as check_adapter
from ._models import context_length as context_length
from ._models import convert_gguf as convert_gguf
from ._models import default_cache_dir as default_cache_dir
from ._models import ensure_embedded_model as ensure_embedded_model
from ._models import load_model as load_model
from ._models import load_tokenizer as load_tokenizer
from ._models import resolve_model as resolve_model
from ._models import sampling_defaults as sampling_defaults
from ._test_models import build_test_model as build_test_model
from ._test_models import model_config_for_shape as model_config_for_shape
