"""Pin the public surface: what `import trio_mlx` offers is a deliberate choice."""

import types

import trio_mlx

EXPECTED = {
    "ContextLengthExceededError",
    "Engine",
    "EngineBrokenError",
    "EngineClosedError",
    "EngineStatistics",
    "Finished",
    "InvalidRequestError",
    "ModelLoadError",
    "QueueFullError",
    "RequestStream",
    "SamplingParams",
    "TextDelta",
    "TokenLogprob",
    "TrioMLXError",
    "Usage",
    "open_engine",
}


def test_public_names():
    public = {
        n for n in dir(trio_mlx) if not n.startswith("_") and not isinstance(getattr(trio_mlx, n), types.ModuleType)
    }
    assert public == EXPECTED


def test_errors_share_one_base():
    for name in EXPECTED:
        obj = getattr(trio_mlx, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, trio_mlx.TrioMLXError), name


def test_importing_the_package_does_not_import_mlx():
    import subprocess
    import sys

    code = "import sys, trio_mlx; sys.exit(1 if any(m == 'mlx' or m.startswith('mlx.') for m in sys.modules) else 0)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
