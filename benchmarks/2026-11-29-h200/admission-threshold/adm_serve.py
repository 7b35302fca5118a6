"""trio-mlx serve with short prompts entering in groups past `batch` only while at least T rows decode
(argv[1]); the thread actor, so the patch applies. For the admission threshold compare."""
import sys

from trio_mlx.actor import _admission as a

T = int(sys.argv.pop(1))
_group = a.Admission.group


def group(self, decoding=0):
    if decoding >= T:
        return _group(self, decoding)
    rows, self.rows = self.rows, self.batch
    try:
        return _group(self, decoding)
    finally:
        self.rows = rows


a.Admission.group = group
from trio_mlx.cli import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
