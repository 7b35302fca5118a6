"""Pins for every behaviour of mlx-lm's BatchGenerator internals that `actor/_batch.py` relies on.

mlx-lm 0.32 offers no public API for these, so an upgrade may change them
silently; each test here names the private attribute it pins and fails first.
"""

from __future__ import annotations

from mlx_lm.generate import BatchGenerator

from trio_mlx.actor import _batch, _shapes
from trio_mlx.models import _models


def _step_tokens(bg, out: dict[int, list[int]]) -> None:
    _, generated = bg.next()
    for r in generated:
        out.setdefault(r.uid, []).append(r.token)


def _caches_state(bg) -> list[tuple[list, list, list, list, int]]:
    import mlx.core as mx

    caches = bg._generation_batch.prompt_cache
    mx.eval([c.state[:4] for c in caches])
    return [(c.keys[..., : c._idx, :].tolist(), c.values[..., : c._idx, :].tolist(), c.offset.tolist(),
             c.left_padding.tolist(), c._idx) for c in caches]


def test_removal_with_one_padding_read_keeps_every_cache_and_token_as_the_stock_filter(tiny_model_fp32):
    """`actor._batch.remove_rows` replaces mlx_lm's per-layer host reads of the padding with
    one read: the caches after each removal, and every token after, must be the
    stock `BatchGenerator.remove`'s, including removals that trim the shared padding."""
    import random

    model, config = _models.load_model(tiny_model_fp32)
    vocab = int(config["vocab_size"])

    def run(remove) -> tuple[dict[int, list[int]], list, int]:
        rng = random.Random(7)
        bg = BatchGenerator(model, max_tokens=10**6, completion_batch_size=64, prefill_batch_size=4)
        out: dict[int, list[int]] = {}
        live: list[int] = []
        states, trimmed = [], 0
        for _ in range(5):
            live += bg.insert([[rng.randrange(3, vocab) for _ in range(rng.randrange(2, 24))] for _ in range(4)])
            for _ in range(5):
                _step_tokens(bg, out)
            before = bg._generation_batch.prompt_cache[0]._idx
            gone, live = live[:3], live[3:]  # the oldest rows: their removal trims the padding
            remove(bg, gone)
            trimmed += bg._generation_batch.prompt_cache[0]._idx < before
            states.append(_caches_state(bg))
        for _ in range(6):
            _step_tokens(bg, out)
        return out, states, trimmed

    stock = run(lambda bg, uids: bg.remove(uids))
    fast = run(_batch.remove_rows)
    assert stock[2] >= 2  # the shared padding was trimmed, so that path is compared too
    assert fast[1] == stock[1]
    assert fast[0] == stock[0] and len(fast[0]) == 20  # every sequence made tokens


def test_removal_leaves_no_filter_override_behind(tiny_model_fp32):
    model, _ = _models.load_model(tiny_model_fp32)
    bg = BatchGenerator(model, max_tokens=10**6, completion_batch_size=8, prefill_batch_size=4)
    uids = bg.insert([[5, 6, 7], [8, 9], [10, 11, 12, 13]])
    for _ in range(4):
        bg.next()
    caches = list(bg._generation_batch.prompt_cache)
    _batch.remove_rows(bg, uids[:1])
    assert all("filter" not in vars(c) for c in caches)
    assert len(bg._generation_batch) == 2


def test_the_prompt_token_counter_counts_every_prompt_token_once(tiny_model_fp32):
    """`bg._counters.prompt_tokens`: read per step (peek) and reset (take) by the actor."""
    model, _ = _models.load_model(tiny_model_fp32)
    bg = BatchGenerator(model, max_tokens=4, completion_batch_size=8, prefill_batch_size=4)
    assert _batch.peek_prompt_tokens(bg) == 0
    bg.insert([[5, 6, 7, 8, 9], [10, 11, 12]])
    counted = 0
    for _ in range(6):
        bg.next()
        peeked = _batch.peek_prompt_tokens(bg)
        taken = _batch.take_prompt_tokens(bg)
        assert peeked == taken and _batch.peek_prompt_tokens(bg) == 0
        counted += taken
    # the last token of each prompt is fed by the first decode step, not the prefill
    assert counted == (5 - 1) + (3 - 1)
    bg.close()


def test_batch_rows_is_the_decoding_batch_size(tiny_model_fp32):
    """`bg._generation_batch`: its length is the rows decoding together (the step trace's `rows`)."""
    model, _ = _models.load_model(tiny_model_fp32)
    bg = BatchGenerator(model, max_tokens=100, completion_batch_size=8, prefill_batch_size=4)
    assert _batch.batch_rows(bg) == 0
    uids = bg.insert([[5, 6, 7], [8, 9], [10, 11, 12, 13]])
    for _ in range(3):
        bg.next()
    assert _batch.batch_rows(bg) == 3
    bg.remove(uids[:1])
    assert _batch.batch_rows(bg) == 2
    bg.close()


def test_first_tokens_are_what_the_next_step_reports(tiny_model_fp32):
    """`actor._batch.first_tokens` reads, after the step that ends a prompt, the sampled first
    tokens (`GenerationBatch._next_tokens`, `_next_logprobs`, `uids`, `Response`): the next
    `next()` must report the same tokens and logprobs for those rows."""
    import mlx.core as mx

    model, _ = _models.load_model(tiny_model_fp32)
    bg = BatchGenerator(model, max_tokens=10**6, completion_batch_size=8, prefill_batch_size=4)
    uids = bg.insert([[5, 6, 7, 8, 9], [11, 12, 13]])
    for _ in range(8):
        prompts, generated = bg.next()
        assert not generated
        if sum(p.end_of_prompt for p in prompts) == 2:
            break
    first = _batch.first_tokens(bg, [uids[1], uids[0], 12345])  # an unknown uid is left out
    assert [r.uid for r in first] == [uids[1], uids[0]] and all(r.finish_reason is None for r in first)
    _, generated = bg.next()
    reported = {r.uid: r for r in generated}
    for r in first:
        assert r.token == reported[r.uid].token
        assert mx.allclose(r.logprobs, reported[r.uid].logprobs).item()


def test_copy_rows_copies_what_the_stock_extract_does_without_reading_the_padding(tiny_model_fp32):
    """`actor._batch.copy_rows` relies on `BatchKVCache` keeping rows right-aligned at `_idx`
    and on `GenerationBatch.tokens[i]` listing the ids whose KV row i holds: each copy must
    equal mlx_lm's `BatchKVCache.extract` (which reads the padding), cut to the asked length,
    after inserts of unequal prompts, removals that trim the padding, and decode steps."""
    import random

    import mlx.core as mx

    model, config = _models.load_model(tiny_model_fp32)
    vocab = int(config["vocab_size"])
    rng = random.Random(3)
    bg = BatchGenerator(model, max_tokens=10**6, completion_batch_size=16, prefill_batch_size=4)
    live: list[int] = []
    checked = 0
    for round_ in range(3):
        live += bg.insert([[rng.randrange(3, vocab) for _ in range(rng.randrange(2, 30))] for _ in range(4)])
        for _ in range(3 + round_):
            bg.next()
        batch = bg._generation_batch
        wanted = {uid: len(batch.tokens[i]) - (i % 3) for i, uid in enumerate(batch.uids)}
        copies = _batch.copy_rows(bg, wanted)
        assert set(copies) == set(batch.uids)
        for i, uid in enumerate(batch.uids):
            layers, tokens = copies[uid]
            n = wanted[uid]
            assert tokens == batch.tokens[i][:n]
            for kv, stock in zip(layers, [c.extract(i) for c in batch.prompt_cache], strict=True):
                assert kv.offset == n and kv.keys.shape[2] == n
                assert mx.array_equal(kv.keys, stock.keys[..., :n, :]).item()
                assert mx.array_equal(kv.values, stock.values[..., :n, :]).item()
                checked += 1
        _batch.remove_rows(bg, live[:2])  # the oldest: trims the shared padding
        live = live[2:]
    assert checked >= 2 * 8
    bg.close()


def test_inserting_copied_kv_with_its_tokens_continues_as_a_cold_prompt(tiny_model_fp32):
    """`BatchGenerator.insert(caches=..., all_tokens=...)`: a row entered with a prefix's KV
    (a `KVCache` that shares the copy's arrays, cut short by its `offset`) and only the rest of
    its prompt generates a cold row's greedy tokens; the caches given are only read (the
    prompt cache hands out its entries' arrays), and `tokens` holds the whole prompt."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    model, _ = _models.load_model(tiny_model_fp32)
    prompt = [5 + (7 * i) % 300 for i in range(60)]

    def greedy(bg, uid, n):
        out = []
        while len(out) < n:
            for r in bg.next()[1]:
                if r.uid == uid:
                    out.append(r.token)
        return out

    cold = BatchGenerator(model, max_tokens=10**6, completion_batch_size=4, prefill_batch_size=4)
    (uid,) = cold.insert([prompt + [9, 10, 11]])
    expected = greedy(cold, uid, 8)
    cold.close()

    bg = BatchGenerator(model, max_tokens=10**6, completion_batch_size=4, prefill_batch_size=4)
    (first,) = bg.insert([prompt + [44, 45]])
    greedy(bg, first, 2)
    (layers, tokens), = _batch.copy_rows(bg, {first: len(prompt)}).values()
    mx.eval([(kv.keys, kv.values) for kv in layers])
    before = [(mx.array(kv.keys), mx.array(kv.values)) for kv in layers]
    views = []
    for kv in layers:
        v = KVCache()
        v.keys, v.values, v.offset = kv.keys, kv.values, len(prompt) - 5
        views.append(v)
    rest = (prompt + [9, 10, 11])[len(prompt) - 5 :]
    (uid,) = bg.insert([rest], caches=[views], all_tokens=[prompt[: len(prompt) - 5]])
    assert greedy(bg, uid, 8) == expected
    idx = bg._generation_batch.uids.index(uid)
    assert bg._generation_batch.tokens[idx][: len(prompt) + 3] == prompt + [9, 10, 11]
    for kv, (k, v) in zip(layers, before, strict=True):  # the given arrays were not written
        assert mx.array_equal(kv.keys, k).item() and mx.array_equal(kv.values, v).item()
    assert _batch.plain_kv(model)
    bg.close()


def test_causal_prefill_is_the_array_masks_prefill_where_no_row_is_left_padded(tiny_model_fp32, monkeypatch):
    """`actor._batch.CausalPrefill` relies on mlx_lm's models taking their mask from layer 0's
    `make_mask` and on `BatchKVCache` keeping left padding only: with none, "causal" must
    give the array mask's logits (a cached prefix included); with some, the array mask
    stays; the override never outlives the call."""
    import mlx.core as mx
    from mlx_lm.models import llama
    from mlx_lm.models.cache import BatchKVCache

    model, config = _models.load_model(tiny_model_fp32)
    layers = int(config["num_hidden_layers"])
    wrapped = _batch.CausalPrefill(model)
    assert wrapped.layers is model.layers  # what the BatchGenerator reads of the model
    masks: list[str] = []
    sdpa = llama.scaled_dot_product_attention

    def spy(queries, *args, **kwargs):
        mask = kwargs.get("mask")
        masks.append(mask if isinstance(mask, str) else type(mask).__name__)
        return sdpa(queries, *args, **kwargs)

    monkeypatch.setattr(llama, "scaled_dot_product_attention", spy)

    def run(forward, padding: list[int]) -> mx.array:
        caches = [BatchKVCache(padding) for _ in range(layers)]
        rows = len(padding)
        forward(mx.array([[5 + (7 * i + r) % 400 for i in range(40)] for r in range(rows)]), cache=caches)
        out = forward(mx.array([[9 + (3 * i + r) % 400 for i in range(24)] for r in range(rows)]), cache=caches)
        assert "make_mask" not in vars(caches[0])
        mx.eval(out)
        return out

    for padding in ([0, 0], [0, 5]):
        base = run(model, padding)
        masks.clear()
        got = run(wrapped, padding)
        assert mx.array_equal(base, got).item()
        assert set(masks) == ({"causal"} if padding == [0, 0] else {"array"}) and len(masks) == 2 * layers
    # on the shape grid (CUDA's) an unpadded step runs padded on the right to a power of two
    # and its KV is trimmed back: the same logits, and the same KV for the next step
    base = run(model, [0, 0])
    masks.clear()
    got = run(_batch.CausalPrefill(model, grid=True), [0, 0])
    assert got.shape == base.shape and mx.allclose(base, got, atol=1e-4).item()
    assert set(masks) == {"causal"}


def test_on_the_grid_a_left_padded_prefill_runs_in_chunks_its_scores_allow(tiny_model_fp32, monkeypatch):
    """A prefill step with left padding (mlx_lm's array mask: MLX materializes its scores) on
    the grid, where the actor leaves chunks whole: `CausalPrefill` runs it in chunks that
    `prefill_chunk` allows for its heads, and the KV and the next step's logits are the
    unchunked step's."""
    import mlx.core as mx
    from mlx_lm.models import llama
    from mlx_lm.models.cache import BatchKVCache

    model, config = _models.load_model(tiny_model_fp32)
    layers, heads = int(config["num_hidden_layers"]), int(config["num_attention_heads"])
    queries: list[int] = []
    sdpa = llama.scaled_dot_product_attention

    def spy(q, *args, **kwargs):
        queries.append(q.shape[2])
        return sdpa(q, *args, **kwargs)

    monkeypatch.setattr(llama, "scaled_dot_product_attention", spy)
    # 2 rows x 4 heads x 600 keys x 4 bytes: 2 MB of scores hold 200 query tokens, cut to 128
    monkeypatch.setattr(_shapes, "ATTENTION_SCRATCH", 2_000_000)

    def run(forward) -> tuple[mx.array, list[mx.array]]:
        caches = [BatchKVCache([0, 5]) for _ in range(layers)]
        forward(mx.array([[5 + (7 * i + r) % 400 for i in range(40)] for r in range(2)]), cache=caches)
        forward(mx.array([[9 + (3 * i + r) % 400 for i in range(500)] for r in range(2)]), cache=caches)
        out = forward(mx.array([[11, 12], [13, 14]]), cache=caches)
        mx.eval(out)
        return out, [c.keys[..., : c._idx, :] for c in caches]

    base, base_keys = run(model)
    queries.clear()
    got, keys = run(_batch.CausalPrefill(model, grid=True, heads=heads))
    assert queries == [40] * layers + [128] * 3 * layers + [116] * layers + [2] * layers
    assert mx.allclose(base, got, atol=1e-4).item()
    assert all(mx.allclose(a, b, atol=1e-4).item() for a, b in zip(base_keys, keys, strict=True))


def test_a_grid_prefill_generates_what_the_stock_one_does(tiny_model_fp32, monkeypatch):
    """A BatchGenerator over `CausalPrefill(model, grid=True)`: prompts of different lengths
    (mlx_lm's own right padding, rolled away after), a hit on a cached prefix, chunked
    prompts: every greedy token is the stock generator's, and no cache keeps the override.
    A prefill step of several rows calls MLX's fused attention one row at a time (the
    one-row shapes warm-up builds), and the function is MLX's own again after."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    model, _ = _models.load_model(tiny_model_fp32)
    rows: list[tuple[int, int]] = []  # (rows, query length) of each fused attention call
    sdpa = mx.fast.scaled_dot_product_attention

    def spy(queries, *args, **kwargs):
        rows.append((queries.shape[0], queries.shape[2]))
        return sdpa(queries, *args, **kwargs)

    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", spy)

    def tokens(forward) -> dict[int, list[int]]:
        bg = BatchGenerator(forward, max_tokens=12, completion_batch_size=8, prefill_batch_size=4,
                            prefill_step_size=256)
        prompts = [[5 + (7 * i + r) % 400 for i in range(n)] for r, n in enumerate((45, 45, 300))]
        uids = bg.insert(prompts)
        out: dict[int, list[int]] = {}
        while len(out) < 3 or any(len(v) < 12 for v in out.values()):
            _step_tokens(bg, out)
        # a hit: a prefix's KV, prefilled alone, then the rest of the prompt
        prefix = prompts[2][:48]
        cache = [KVCache() for _ in model.layers]
        model(mx.array([prefix]), cache=cache)
        (hit,) = bg.insert([prompts[2][48:] + [9, 9, 9]], caches=[cache], all_tokens=[prefix])
        while len(out.get(hit, [])) < 12:
            _step_tokens(bg, out)
        assert not any("update_and_fetch" in vars(c) for c in bg._generation_batch.prompt_cache)
        return {k: out[k] for k in [*uids, hit]}

    stock = tokens(model)
    assert {n for n, q in rows if q > 1} == {1, 3}  # stock: the three prompts in one call, then the hit
    rows.clear()
    assert list(tokens(_batch.CausalPrefill(model, grid=True)).values()) == list(stock.values())
    assert {n for n, q in rows if q > 1} == {1} and 3 in {n for n, q in rows if q == 1}  # decode steps stay one call
    assert mx.fast.scaled_dot_product_attention is spy


def test_the_warm_up_runs_every_grid_shape_once(tiny_model_fp32, monkeypatch):
    """`_warmup.prebuild_prefill` runs, for one row, each grid query length behind each
    multiple of the stride that fits the limit, through the grid-prefilling model."""
    from mlx_lm.models import llama

    from trio_mlx.actor._warmup import prebuild_prefill

    model, config = _models.load_model(tiny_model_fp32)
    shapes: list[tuple[int, int, int]] = []
    sdpa = llama.scaled_dot_product_attention

    def spy(queries, keys, *args, **kwargs):
        shapes.append((queries.shape[0], queries.shape[2], keys.shape[2]))
        return sdpa(queries, keys, *args, **kwargs)

    monkeypatch.setattr(llama, "scaled_dot_product_attention", spy)
    layers = int(config["num_hidden_layers"])
    ran = prebuild_prefill(_batch.CausalPrefill(model, grid=True), layers, 1, 400, [128, 256], 128)
    seen = sorted(set(shapes))
    assert ran == 5
    assert seen == [(1, 128, 128), (1, 128, 256), (1, 128, 384), (1, 256, 256), (1, 256, 384)]
    assert len(shapes) == layers * (ran + 2)  # and the two strides that built the context


def test_keep_leading_space_reaches_both_of_mlx_lms_trimming_detokenizers(tiny_model_fp32):
    # engine/_text.py's keep_leading_space relies on these two hooks of mlx_lm's detokenizers.
    import inspect

    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer

    from trio_mlx.engine._text import keep_leading_space

    assert "trim_space" in inspect.signature(SPMStreamingDetokenizer.__init__).parameters
    tok = _models.load_tokenizer(tiny_model_fp32)
    detok = tok.detokenizer
    assert isinstance(detok, BPEStreamingDetokenizer)
    ids = tok.encode(" the fox")
    for keep, expected in ((False, "the fox"), (True, " the fox")):
        detok.reset()
        if keep:
            keep_leading_space(detok)
        for i in ids:
            detok.add_token(i)
        detok.finalize()
        assert detok.text == expected


def test_take_rows_and_roll_right_are_the_gather_and_the_roll_they_replace(monkeypatch):
    """`actor._batch.take_rows` (a removal's kept rows) and `roll_right` (a right-padded
    prefill's roll) copy by slices what mlx_lm gathers element by element: the same
    arrays, for every pattern of kept rows and of shifts (none, all, a whole turn), with
    rows rolled as slices and as the gather (small slabs)."""
    import itertools
    import random

    import mlx.core as mx
    from mlx_lm.models.cache import dynamic_roll

    a = mx.random.normal((5, 2, 11, 3), key=mx.random.key(3))
    for n in range(1, 6):
        for rows in itertools.combinations(range(5), n):
            assert mx.array_equal(_batch.take_rows(a, list(rows)), a[mx.array(rows)]).item(), rows
    assert mx.array_equal(_batch.take_rows(a, [3, 1, 2]), a[mx.array([3, 1, 2])]).item()
    rng = random.Random(5)
    patterns = [[0] * 5, [11] * 5, [4, 0, 0, 7, 1], [0, 0, 0, 0, 3], [2, 0, 0, 0, 0], [22, 1, 0, 10, 0]]
    patterns += [[rng.randrange(0, 12) for _ in range(5)] for _ in range(30)]
    for limit in (0, 1 << 30):
        monkeypatch.setattr(_batch, "ROLL_SLICE_BYTES", limit)
        for shifts in patterns:
            want = dynamic_roll(a, mx.array(shifts)[:, None], axis=2)
            assert mx.array_equal(_batch.roll_right(a, shifts), want).item(), (limit, shifts)


def test_a_right_padded_group_prefill_rolls_by_slices_and_generates_what_the_stock_one_does(
        tiny_model_fp32, monkeypatch):
    """Prompts of different lengths prefill right-padded, and mlx_lm's `BatchKVCache.finalize`
    rolls the padding to the left with `dynamic_roll`, a gather (79 ms for a chat turn's 8
    rows on an H100). Under `CausalPrefill` the roll is `roll_right`'s (as slices for large
    slabs): mlx_lm's `dynamic_roll` is never called, every greedy token is the stock
    generator's, and no cache keeps the override."""
    from mlx_lm.models import cache as mlx_cache

    model, _ = _models.load_model(tiny_model_fp32)
    rolls: list[int] = []
    stock_roll = mlx_cache.dynamic_roll

    def spy(x, shifts, axis):
        rolls.append(x.shape[0])
        return stock_roll(x, shifts, axis)

    monkeypatch.setattr(mlx_cache, "dynamic_roll", spy)
    monkeypatch.setattr(_batch, "ROLL_SLICE_BYTES", 0)  # the tiny model's slabs are small

    def tokens(forward) -> list[list[int]]:
        bg = BatchGenerator(forward, max_tokens=10, completion_batch_size=8, prefill_batch_size=4)
        prompts = [[5 + (7 * i + r) % 400 for i in range(n)] for r, n in enumerate((40, 23, 57, 40))]
        uids = bg.insert(prompts)
        out: dict[int, list[int]] = {}
        while len(out) < 4 or any(len(v) < 10 for v in out.values()):
            _step_tokens(bg, out)
        assert not any("finalize" in vars(c) for c in bg._generation_batch.prompt_cache)
        return [out[u] for u in uids]

    stock = tokens(model)
    assert rolls  # the stock prefill rolled its right padding away
    rolls.clear()
    assert tokens(_batch.CausalPrefill(model)) == stock
    assert rolls == []


def test_prompts_that_end_move_to_decoding_without_a_deep_copy(tiny_model_fp32, monkeypatch):
    """mlx_lm's `PromptProcessingBatch.split` deep-copies the prompt batch's caches and then
    gathers each side's rows (`BatchKVCache.filter`). Under `move_whole_groups` a group whose
    every prompt has ended goes to the decoding batch as it is, and prompts that end before
    their group's others (a long one chunked) leave with their rows kept as slices on both
    sides: no deep copy, no stock filter, and every greedy token the stock generator's, for
    a first group and for one joining rows that already decode."""
    import copy

    from mlx_lm.models.cache import BatchKVCache

    model, _ = _models.load_model(tiny_model_fp32)
    calls: list[str] = []
    deepcopy, keep = copy.deepcopy, BatchKVCache.filter

    def spy_copy(x, *args, **kwargs):
        calls.append("deepcopy")
        return deepcopy(x, *args, **kwargs)

    def spy_filter(self, rows):
        calls.append("filter")
        return keep(self, rows)

    monkeypatch.setattr(copy, "deepcopy", spy_copy)
    monkeypatch.setattr(BatchKVCache, "filter", spy_filter)

    def tokens(move: bool, lengths: tuple[int, ...]) -> list[list[int]]:
        bg = BatchGenerator(model, max_tokens=10**6, completion_batch_size=8, prefill_batch_size=4,
                            prefill_step_size=32)
        if move:
            _batch.move_whole_groups(bg)
        prompts = [[5 + (7 * i + r) % 400 for i in range(n)] for r, n in enumerate(lengths)]
        uids = bg.insert(prompts[:3])
        out: dict[int, list[int]] = {}
        for _ in range(3):
            _step_tokens(bg, out)
        uids += bg.insert(prompts[3:])
        while len(out) < 5 or any(len(v) < 8 for v in out.values()):
            _step_tokens(bg, out)
        return [out[u][:8] for u in uids]

    whole = (12, 20, 30, 9, 15)  # every prompt within one prefill step: each group ends together
    stock = tokens(False, whole)
    assert "deepcopy" in calls and "filter" in calls
    calls.clear()
    assert tokens(True, whole) == stock
    assert calls == []
    chunked = (12, 20, 70, 9, 15)  # 12 and 20 end a step before 70, which takes three
    calls.clear()
    stock = tokens(False, chunked)
    assert calls.count("deepcopy") >= 2  # the partial splits, then the whole ones
    calls.clear()
    assert tokens(True, chunked) == stock
    assert calls == []


def test_an_owned_decode_step_keeps_the_batch_as_mlx_lm_keeps_it(tiny_model_fp32):
    """`actor._batch.own_decode` builds a finished group's decoding batch itself
    (`_owned_generate`: `GenerationBatch` made empty, then given its rows) and steps it
    (`_owned_step`, `_owned_next`): it must set every attribute mlx_lm's own
    `GenerationBatch.__init__` and `_step` set (its `extend` and `filter` read them), keep
    `tokens` (what each row's KV holds: `copy_rows`) and `_next_tokens` as they do, and
    `BatchGenerator._next` must count its report by `len()`; the greedy tokens are the
    stock generator's, with rows entering and leaving, and every layer's cache holds the
    stock offsets in one array (`_step_caches.share_offsets`). A group that joins the decoding rows'
    step (`_join`: `bg._currently_processing`'s segments and progress, the prompt batch's
    `Response`) has the prompt responses `_next` would have given it (`next_step`)."""
    from trio_mlx.actor._decode import Decoder, DecodeRow
    from trio_mlx.actor._protocol import SamplingParams

    model, _ = _models.load_model(tiny_model_fp32)
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13], [20, 21, 22, 23, 24, 25, 26]]

    def run(owned: bool) -> tuple[dict[int, list[int]], set[str], list[list[int]], int, list[tuple]]:
        bg = BatchGenerator(model, max_tokens=10**6, completion_batch_size=8, prefill_batch_size=2)
        _batch.move_whole_groups(bg)
        rows = None
        if owned:
            _batch.own_decode(bg, Decoder())
            rows = [DecodeRow(SamplingParams(temperature=0.0), p) for p in prompts[:2]]
        out: dict[int, list[int]] = {}
        prompted: list[tuple] = []
        uids = bg.insert(prompts[:2], samplers=rows)

        def step() -> None:
            responses, generated = _batch.next_step(bg) if owned else bg.next()
            prompted.extend((r.uid, r.progress, r.end_of_segment, r.end_of_prompt) for r in responses)
            for uid, token in _reports(generated):
                out.setdefault(uid, []).append(token)

        for _ in range(4):
            step()
        _batch.remove_rows(bg, uids[:1])
        uids += bg.insert(prompts[2:], samplers=[DecodeRow(SamplingParams(temperature=0.0), prompts[2])] if owned
                          else None)
        for _ in range(6):
            step()
        batch = bg._generation_batch
        held = [list(t) for t in batch.tokens]
        assert len(batch._next_tokens.tolist()) == len(batch.uids) == 2
        offsets = {id(c.offset) for c in batch.prompt_cache}  # one array for every layer where owned
        assert len(offsets) == (1 if owned else len(batch.prompt_cache))
        offsets_held = [c.offset.tolist() for c in batch.prompt_cache]
        return (out, set(vars(batch)) - {"_step", "next"}, held, bg._counters.generation_tokens, prompted,
                offsets_held)

    stock, owned = run(False), run(True)
    assert owned[5] == stock[5]
    assert owned[0] == stock[0] and len(owned[0]) == 3
    assert owned[1] == stock[1]
    assert owned[2] == stock[2]
    assert owned[3] == stock[3] > 0
    assert owned[4] == stock[4] and (2, (7, 7), True, True) in stock[4]  # the third prompt's end, joined


def _reports(generated) -> list[tuple[int, int]]:
    if isinstance(generated, _batch.Decoded):
        return list(zip(generated.uids, generated.tokens, strict=True))
    return [(r.uid, r.token) for r in generated]


def test_a_one_token_step_of_an_unpadded_batch_has_no_attention_mask():
    """`unmask_unpadded`: no row padded, no mask at one token (a plain cache has none); a padded
    batch keeps mlx_lm's; rows leaving (a new padding array) are looked at again. It says
    which it found, also when it answers from what it last read."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    from trio_mlx.actor._step_caches import unmask_unpadded

    def filled(padding: list[int]) -> list[BatchKVCache]:
        caches = [BatchKVCache(padding) for _ in range(2)]
        kv = mx.zeros((len(padding), 1, 4, 8))
        for c in caches:
            c.update_and_fetch(kv, kv)
        return caches

    plain = filled([0, 0])
    assert unmask_unpadded(plain) and unmask_unpadded(plain)
    assert all(c.make_mask(1) is None for c in plain)
    assert plain[0].make_mask(3) is not None  # a longer query still gets its causal mask
    padded = filled([0, 2])
    assert not unmask_unpadded(padded) and not unmask_unpadded(padded)
    mask = padded[1].make_mask(1)
    assert mask is not None and mask.tolist() == [[[[True] * 5]], [[[False, False, True, True, True]]]]
    for c in padded:
        c.filter([0])  # the padded row leaves: mlx_lm trims the padding all rows share
    assert unmask_unpadded(padded)
    assert all(c.make_mask(1) is None for c in padded)


def test_layers_sharing_one_offset_array_stay_as_layers_that_do_not():
    """`share_offsets` leaves one offset array in every layer's cache: sound only while mlx_lm's
    batch caches (and `_kv_quant`'s) assign a new offset array in each method, never change one
    in place (`+=` on an MLX array changes it for every holder, so each layer's call would
    land on all of them). Each method a decoding batch's caches go through, called layer by
    layer, must leave shared and unshared caches with the same offsets; and caches at
    different positions keep their own."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    from trio_mlx.actor._kv_quant import BatchQuantizedKVCache
    from trio_mlx.actor._step_caches import share_offsets

    def layers(kind, shared: bool) -> list:
        made = [kind([1, 0]) if kind is BatchKVCache else kind([1, 0], 32, 8) for _ in range(3)]
        kv = mx.ones((2, 1, 3, 32))
        for c in made:
            c.update_and_fetch(kv, kv)
        if shared:
            share_offsets(made)
            assert len({id(c.offset) for c in made}) == 1
        return made

    def other(kind) -> list:
        made = [kind([2]) if kind is BatchKVCache else kind([2], 32, 8) for _ in range(3)]
        for c in made:
            c.update_and_fetch(mx.ones((1, 1, 4, 32)), mx.ones((1, 1, 4, 32)))
        return made

    for kind in (BatchKVCache, BatchQuantizedKVCache):
        steps = [
            lambda c, i: c.update_and_fetch(mx.ones((2, 1, 1, 32)), mx.ones((2, 1, 1, 32))),
            lambda c, i: c.trim(1),
            lambda c, i, kind=kind: c.extend(other(kind)[i]),
            lambda c, i: c.filter([0, 2]),
            lambda c, i: c.update_and_fetch(mx.ones((2, 1, 1, 32)), mx.ones((2, 1, 1, 32))),
        ]
        a, b = layers(kind, True), layers(kind, False)
        for step in steps:
            for i, (x, y) in enumerate(zip(a, b, strict=True)):
                step(x, i)
                step(y, i)
            assert [c.offset.tolist() for c in a] == [c.offset.tolist() for c in b]
        assert a[0].offset.tolist() == [3, 3]
        apart = layers(kind, False)
        apart[1].trim(1)
        share_offsets(apart)  # layer 1 is behind the others: no sharing
        assert [c.offset.tolist() for c in apart] == [[2, 3], [1, 2], [2, 3]]


def test_prompts_left_counts_what_the_next_prefill_steps_take(tiny_model_fp32):
    """`actor._batch.prompts_left` reads `bg._unprocessed_sequences` (each one's segments at
    index 1) and `bg._currently_processing` (at index 0): the prompt tokens each prompt has
    yet to take through a prefill step, its last token (a segment of its own, fed with the
    decode step) left out. And `next()` runs the decoding rows' step and then one chunk of
    `bg.prefill_step_size` tokens of each prompt (`_batch.set_prefill_chunk`), the
    interleaving the actor's prefill budget relies on."""
    model, _ = _models.load_model(tiny_model_fp32)
    bg = BatchGenerator(model, max_tokens=10**6, completion_batch_size=8, prefill_batch_size=4,
                        prefill_step_size=1024)
    (running,) = bg.insert([[5, 6, 7]])
    out: dict[int, list[int]] = {}
    while not out:
        _step_tokens(bg, out)
    assert _batch.prompts_left(bg) == []
    bg.insert([[5 + i % 300 for i in range(300)], [9 + i % 200 for i in range(200)]])
    assert _batch.prompts_left(bg) == [299, 199]  # queued: not yet in the prompt batch
    _batch.set_prefill_chunk(bg, 128)
    _batch.take_prompt_tokens(bg)  # the running prompt's, counted already
    prompts, generated = bg.next()
    assert [r.uid for r in generated] == [running]  # the decode step, in the same call as the chunk
    assert _batch.take_prompt_tokens(bg) == 256 and len(prompts) == 2
    assert _batch.prompts_left(bg) == [171, 71]  # in the prompt batch now, a chunk of 128 each in
    bg.next()
    bg.next()
    assert _batch.prompts_left(bg) == []  # both at their last token, fed with the next decode step


def test_a_dropped_generator_with_the_owned_step_is_freed_without_the_cyclic_collector(tiny_model_fp32):
    """`own_decode`'s overrides hold the decoding batch weakly: a generator the actor drops (a
    reset after a failed step) goes with its KV at once, not at the collector's next pass."""
    import gc
    import weakref

    from trio_mlx.actor._decode import Decoder, DecodeRow
    from trio_mlx.actor._protocol import SamplingParams

    model, _ = _models.load_model(tiny_model_fp32)
    bg = BatchGenerator(model, max_tokens=10**6, completion_batch_size=8, prefill_batch_size=2)
    _batch.move_whole_groups(bg)
    _batch.own_decode(bg, Decoder())
    bg.insert([[5, 6, 7, 8, 9]], samplers=[DecodeRow(SamplingParams(temperature=0.0), [5, 6, 7, 8, 9])])
    for _ in range(3):
        bg.next()
    batch = weakref.ref(bg._generation_batch)
    gc.disable()
    try:
        del bg
        assert batch() is None
    finally:
        gc.enable()


def test_trimming_a_one_row_batch_cache_is_as_if_the_trimmed_tokens_never_went_in(tiny_model_fp32):
    """`_spec_step.rollback` trims a lone row's `BatchKVCache` past its rejected drafts
    (`trim`: `_idx` and `offset` back by n; the next tokens written over the stale ones):
    the logits and the KV after are those of a cache that never held the rejected tokens."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import BatchKVCache

    model, _ = _models.load_model(tiny_model_fp32)
    layers = len(model.layers)
    prompt, kept, rejected, then = [5, 6, 7, 8], [9, 10], [11, 12, 13], [14, 15]
    spec = [BatchKVCache([0]) for _ in range(layers)]
    model(mx.array([prompt]), cache=spec)
    model(mx.array([kept + rejected]), cache=spec)
    for c in spec:
        c.trim(len(rejected))
    plain = [BatchKVCache([0]) for _ in range(layers)]
    model(mx.array([prompt]), cache=plain)
    model(mx.array([kept]), cache=plain)
    a, b = model(mx.array([then]), cache=spec), model(mx.array([then]), cache=plain)
    assert np.allclose(np.array(a), np.array(b), atol=1e-5)
    for x, y in zip(spec, plain, strict=True):
        assert x._idx == y._idx and x.offset.tolist() == y.offset.tolist()
        kx, _ = x.keys_and_values()
        ky, _ = y.keys_and_values()
        assert np.allclose(np.array(kx), np.array(ky), atol=1e-5)


def test_a_group_into_an_empty_batch_ends_its_prompts_in_their_prefills_forward(tiny_model_fp32):
    """`_batch._prompt_end` (`bg._currently_processing`'s segments, the prompt batch's
    `prompt`, `split`, `Response`): prompts of one length into an empty decoding batch end in
    the step that prefills them, their last tokens in the same forward, and decode the stock
    generator's greedy tokens, a step sooner; the KV's tokens are the whole prompts. Prompts of
    different lengths (right padding) take mlx_lm's two steps."""
    from trio_mlx.actor._decode import Decoder, DecodeRow
    from trio_mlx.actor._protocol import SamplingParams

    model, _ = _models.load_model(tiny_model_fp32)

    def run(prompts: list[list[int]], owned: bool) -> tuple[dict[int, list[int]], int, list, list]:
        bg = BatchGenerator(_batch.CausalPrefill(model), max_tokens=10**6, completion_batch_size=8,
                            prefill_batch_size=4)
        _batch.move_whole_groups(bg)
        rows = None
        if owned:
            _batch.own_decode(bg, Decoder())
            rows = [DecodeRow(SamplingParams(temperature=0.0), p) for p in prompts]
        bg.insert(prompts, samplers=rows)
        out: dict[int, list[int]] = {}
        ended: list = []
        for step in range(6):
            responses, generated = _batch.next_step(bg) if owned else bg.next()
            ended += [(step, r.uid) for r in responses if r.end_of_prompt]
            for uid, token in _reports(generated):
                out.setdefault(uid, []).append(token)
        held = [list(t) for t in bg._generation_batch.tokens]
        return out, _batch.batch_rows(bg), ended, held

    same = [[5, 6, 7, 8], [9, 10, 11, 12]]
    stock, owned = run(same, False), run(same, True)
    assert [s for s, _ in owned[2]] == [0, 0]  # both prompts ended with their prefill
    assert [s for s, _ in stock[2]] == [1, 1]  # mlx_lm: the step after
    # a step sooner: the owned run reported the stock run's tokens and one more
    assert all(owned[0][uid][: len(stock[0][uid])] == stock[0][uid] for uid in stock[0])
    assert all(len(owned[0][uid]) == len(stock[0][uid]) + 1 for uid in stock[0])
    assert all(held[: len(p)] == p for held, p in zip(owned[3], same, strict=True))
    apart = [[5, 6, 7], [9, 10, 11, 12, 13]]
    stock, owned = run(apart, False), run(apart, True)
    assert [s for s, _ in owned[2]] == [s for s, _ in stock[2]] == [1, 1]
    assert owned[0] == stock[0]


def test_the_output_head_taken_at_one_position_gives_that_positions_logits():
    """`_shapes.one_position_head`: a model's `lm_head` (untied) and its embedding's `as_linear`
    (tied) shadowed on the instance give the logits of one position; a head under another
    name, or one given the positions flattened, is left alone, and `CausalPrefill.last_logits`
    then returns the last position of every position's logits and sets `one_head` False (`_prompt_end` leaves such a model's
    last tokens to mlx_lm)."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.models import llama
    from mlx_lm.models.cache import make_prompt_cache

    def tiny(tied: bool) -> llama.Model:
        args = llama.ModelArgs(model_type="llama", hidden_size=32, num_hidden_layers=2, intermediate_size=64,
                               num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=50,
                               tie_word_embeddings=tied)
        m = llama.Model(args)
        mx.eval(m.parameters())
        return m

    x = mx.array([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]])
    for tied in (True, False):
        m = tiny(tied)
        full = m(x)
        with _shapes.one_position_head(m, 2):
            one = m(x)
        assert one.shape == (2, 1, 50) and mx.allclose(one[:, 0], full[:, 2], atol=1e-5).item()
        assert "lm_head" not in vars(m) and "as_linear" not in vars(m.model.embed_tokens)  # restored
        wrapped = _batch.CausalPrefill(m)
        last = wrapped.last_logits(x, make_prompt_cache(m))
        assert wrapped.one_head and mx.allclose(last, full[:, -1], atol=1e-5).item()

    class OwnHead(nn.Module):  # a head by another name: `output`
        def __init__(self, base: llama.Model):
            super().__init__()
            self.base = base
            self.output = nn.Linear(32, 50, bias=False)

        @property
        def layers(self):
            return self.base.layers

        def __call__(self, inputs, cache=None):
            return self.output(self.base.model(inputs, cache))

    odd = OwnHead(tiny(False))
    mx.eval(odd.parameters())
    wrapped = _batch.CausalPrefill(odd)
    last = wrapped.last_logits(x, make_prompt_cache(odd.base))
    assert not wrapped.one_head and mx.allclose(last, odd(x)[:, -1], atol=1e-5).item()

    class FlatHead(nn.Module):  # an `lm_head` given the positions flattened, (B x L, D): left alone
        def __init__(self, base: llama.Model):
            super().__init__()
            self.base = base
            self.lm_head = base.lm_head

        @property
        def layers(self):
            return self.base.layers

        def __call__(self, inputs, cache=None):
            h = self.base.model(inputs, cache)
            return self.lm_head(h.reshape(-1, h.shape[-1])).reshape(h.shape[0], h.shape[1], -1)

    flat = FlatHead(tiny(False))
    wrapped = _batch.CausalPrefill(flat)
    last = wrapped.last_logits(x, make_prompt_cache(flat.base))
    assert not wrapped.one_head and mx.allclose(last, flat(x)[:, -1], atol=1e-5).item()
