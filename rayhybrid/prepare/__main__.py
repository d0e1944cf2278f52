"""`python -m rayhybrid.prepare input=... output=... tokenizer=... [key=value ...]`: tokenize a
corpus once into a prepared dataset (read back with rayhybrid.data.open_prepared).

Each document becomes tokenizer(text, add_special_tokens=False) followed by the EOS id, in the
input's order; the token shards and their document lengths are written first and index.json
last, so an output without index.json is never taken for a dataset. Running it again on a
committed output with the same inputs does nothing ("already prepared").

Ray's own output goes to a new file of this user's only (mode 0600, a random name
rayhybrid-prepare-*.log in $TMPDIR or /tmp), removed when the prepare succeeds or is refused,
kept and named in the error line when it fails.

Exit codes: 0 done (or already prepared), 1 failed, 2 bad settings or inputs (one line on stderr).
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile

from rayhybrid.config.prepare import compose_prepare, usage
from rayhybrid.errors import ConfigError, RayHybridError
from rayhybrid.preflight import ensure_logging, exit_codes

EXAMPLES = """Examples:
  python -m rayhybrid.prepare input=books/ output=/data/books-tok tokenizer=/models/llama3
  python -m rayhybrid.prepare input='s3://bucket/raw/*.jsonl.gz' output=s3://bucket/tok tokenizer=tok/ val_fraction=0.01
  python -m rayhybrid.prepare input=wiki.parquet field=article output=gs://b/wiki tokenizer=tok/ workers=8"""


def help_text() -> str:
    from rayhybrid.prepare.formats import FORMATS

    head = __doc__.strip().split("\n\n")
    formats = "Input formats (format=...):\n" + "\n".join(f"  {f.name}\n      {f.help}" for f in FORMATS.values())
    return "\n\n".join([head[0], "Settings (key=value):\n" + usage(), formats, *head[1:], EXAMPLES])


def private_log() -> tuple[int, str]:
    """A new file for Ray's output, readable by this user only: mkstemp creates it with mode
    0600 under a random name ($TMPDIR or the system's temporary directory), never opening a
    file or link that is already there."""
    return tempfile.mkstemp(prefix="rayhybrid-prepare-", suffix=".log")


@contextlib.contextmanager
def ray_output_to(fd: int, path: str):
    """Meanwhile, file descriptor 2 goes to the open file `fd` (at `path`): Ray's and Ray
    Data's own log lines (from C++ too) stay out of the terminal, where the phases are printed
    and a failure is one line. Kept when the prepare fails for another reason than a refusal;
    `fd` is closed."""
    sys.stderr.flush()
    saved = os.dup(2)
    os.dup2(fd, 2)
    os.close(fd)
    try:
        yield
    except ConfigError:
        with contextlib.suppress(OSError):
            os.remove(path)
        raise
    else:
        with contextlib.suppress(OSError):
            os.remove(path)
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(help_text())
        return
    with exit_codes("rayhybrid.prepare"):
        cfg = compose_prepare(argv)
        ensure_logging()
        from rayhybrid.prepare.run import prepare
        from rayhybrid.storage.store import one_line

        try:
            fd, log = private_log()
        except OSError as err:
            raise RayHybridError(
                f"cannot create a file for Ray's output in {tempfile.gettempdir()} ({one_line(err)}); "
                "set TMPDIR to a directory you can write to"
            ) from None
        try:
            with ray_output_to(fd, log):
                prepare(cfg)
        except RayHybridError as err:
            if isinstance(err, ConfigError):
                raise
            raise RayHybridError(f"{err} (Ray's log: {log})") from None
        except Exception as err:  # noqa: BLE001 - any other failure is one line and exit 1 too
            raise RayHybridError(f"prepare failed: {one_line(err)} (Ray's log: {log})") from None


if __name__ == "__main__":
    main()
