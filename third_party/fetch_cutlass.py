"""Extract CUTLASS headers from the pinned nvidia-cutlass wheel into third_party/cutlass/.

The wheel ships CUTLASS's C++ headers under cutlass_library/source/. We take `include/` and
`tools/util/include/` only. Nothing here is committed (third_party/cutlass is git-ignored).

    python third_party/fetch_cutlass.py [--force]
"""

import argparse
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

VERSION = "4.2.0.0"
DEST = Path(__file__).resolve().parent / "cutlass"
PREFIX = "cutlass_library/source/"
KEEP = ("include/", "tools/util/include/")


def fetch(force: bool = False) -> Path:
    stamp = DEST / ".version"
    if not force and stamp.exists() and stamp.read_text().strip() == VERSION:
        print(f"third_party/cutlass: CUTLASS {VERSION} headers already present")
        return DEST
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "-d",
            tmp,
            f"nvidia-cutlass=={VERSION}",
        ]
        print("third_party/cutlass:", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
        wheels = list(Path(tmp).glob("nvidia_cutlass-*.whl"))
        if len(wheels) != 1:
            sys.exit(
                f"third_party/cutlass: expected one nvidia_cutlass wheel in {tmp}, found {wheels}"
            )
        count = 0
        with zipfile.ZipFile(wheels[0]) as zf:
            for name in zf.namelist():
                if not name.startswith(PREFIX) or name.endswith("/"):
                    continue
                rel = name[len(PREFIX) :]
                if not rel.startswith(KEEP):
                    continue
                out = DEST / rel
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_bytes(zf.read(name))
                count += 1
    if not (DEST / "include" / "cutlass" / "cutlass.h").exists():
        sys.exit("third_party/cutlass: the wheel did not contain include/cutlass/cutlass.h")
    stamp.write_text(VERSION + "\n")
    print(f"third_party/cutlass: extracted {count} headers from nvidia-cutlass {VERSION}")
    return DEST


if __name__ == "__main__":
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--force", action="store_true", help="extract again even if present")
    fetch(ap.parse_args().force)
