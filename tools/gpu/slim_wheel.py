"""A wheel repacked without the paths a GPU check never imports, for hosts without package
access where what is copied over with the working tree (`.whl/`) is limited in size. Ray's
wheel is most of that: without its RLlib, its LLM library
and the dashboard's JavaScript and media it is about 5 MB smaller. The dashboard's build
directory and its index.html stay (the dashboard refuses to start without them), and each
removed file leaves the wheel's RECORD too.

    python -m tools.gpu.slim_wheel .whl/ray-*.whl            # Ray's default paths, in place
    python -m tools.gpu.slim_wheel WHEEL --drop pkg/sub ...  # other paths (prefixes in the wheel)

Prints the wheel's size before and after."""

from __future__ import annotations

import argparse
import os
import tempfile
import zipfile
from pathlib import Path

# what dflash-serve's GPU runs never import from Ray (Serve, Core and the dashboard's API
# are what they use)
RAY_UNUSED = ("ray/rllib/", "ray/llm/", "ray/dashboard/client/build/static/js/",
              "ray/dashboard/client/build/static/media/",
              "ray/dashboard/client/build/speedscope-1.5.3/")


def dropped(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name.startswith(p.rstrip("/") + "/") or name == p.rstrip("/")
               for p in prefixes)


def slim(wheel: Path, prefixes: tuple[str, ...]) -> tuple[int, int]:
    """Rewrite `wheel` without the entries under `prefixes` (and their RECORD lines).
    Returns its sizes in bytes, before and after."""
    before = wheel.stat().st_size
    with zipfile.ZipFile(wheel) as src:
        infos = [i for i in src.infolist() if not dropped(i.filename, prefixes)]
        # the wheel's own RECORD: top level (vendored packages inside may bring theirs)
        records = [i for i in infos if i.filename.endswith(".dist-info/RECORD")
                   and i.filename.count("/") == 1]
        if len(records) != 1:
            raise ValueError(f"{wheel} has {len(records)} top-level RECORD files, not one")
        fd, tmp = tempfile.mkstemp(dir=wheel.parent, suffix=".whl")
        os.close(fd)
        try:
            with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as out:
                for info in infos:
                    data = src.read(info)
                    if info is records[0]:
                        lines = data.decode().splitlines(keepends=True)
                        data = "".join(line for line in lines
                                       if not dropped(line.split(",", 1)[0], prefixes)).encode()
                    out.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
            os.replace(tmp, wheel)
        except BaseException:
            os.unlink(tmp)
            raise
    return before, wheel.stat().st_size


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("wheels", nargs="+", type=Path)
    p.add_argument("--drop", nargs="+", default=list(RAY_UNUSED),
                   help="path prefixes inside the wheel to remove (default: Ray's unused)")
    args = p.parse_args(argv)
    for wheel in args.wheels:
        before, after = slim(wheel, tuple(args.drop))
        print(f"{wheel}: {before / 1e6:.1f} MB -> {after / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
