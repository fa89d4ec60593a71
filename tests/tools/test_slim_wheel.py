"""tools/gpu/slim_wheel.py: a wheel repacked without the given paths, its RECORD with them, the
rest byte for byte, and still installable by pip."""

import subprocess
import sys
import zipfile

import pytest

from tools.gpu import slim_wheel

FILES = {
    "ray/__init__.py": b"VERSION = 1\n",
    "ray/rllib/algo.py": b"x = 1\n",
    "ray/rllibx/keep.py": b"kept = True\n",  # a prefix's name inside another's: stays
    # a vendored package's own RECORD: not the wheel's, left as it is
    "ray/thirdparty/dep-1.0.dist-info/RECORD": b"dep/__init__.py,,\n",
    "ray/dashboard/client/build/index.html": b"<html></html>\n",
    "ray/dashboard/client/build/static/js/main.js": b"//" + b"j" * 5000 + b"\n",
    "ray/dashboard/client/build/static/css/main.css": b"body {}\n",
    "ray-2.60.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: ray\nVersion: 2.60.0\n",
    "ray-2.60.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: "
                                  b"true\nTag: py3-none-any\n",
}


def fake_wheel(path):
    record = "".join(f"{name},,\n" for name in FILES) + "ray-2.60.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in FILES.items():
            z.writestr(name, data)
        z.writestr("ray-2.60.0.dist-info/RECORD", record)


def test_the_paths_leave_the_wheel_and_its_record_and_pip_installs_the_rest(tmp_path):
    wheel = tmp_path / "ray-2.60.0-py3-none-any.whl"
    fake_wheel(wheel)
    slim_wheel.main([str(wheel)])  # Ray's default paths
    gone = {"ray/rllib/algo.py", "ray/dashboard/client/build/static/js/main.js"}
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        assert names == (set(FILES) - gone) | {"ray-2.60.0.dist-info/RECORD"}
        assert all(z.read(n) == FILES[n] for n in names if n in FILES)
        listed = {line.split(",")[0] for line in z.read("ray-2.60.0.dist-info/RECORD")
                  .decode().splitlines()}
    assert listed == names
    site = tmp_path / "site"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index",
                          "--no-deps", "--no-compile", "--target", str(site), str(wheel)],
                         capture_output=True, text=True, timeout=120)
    assert pip.returncode == 0, pip.stderr
    assert (site / "ray/rllibx/keep.py").read_bytes() == b"kept = True\n"
    assert (site / "ray/dashboard/client/build/index.html").is_file()
    assert not (site / "ray/rllib").exists()
    assert not (site / "ray/dashboard/client/build/static/js").exists()


def test_other_paths_and_a_wheel_without_one_record(tmp_path):
    wheel = tmp_path / "w-1-py3-none-any.whl"
    fake_wheel(wheel)
    before, after = slim_wheel.slim(wheel, ("ray/rllibx",))
    assert after < before
    with zipfile.ZipFile(wheel) as z:
        assert "ray/rllibx/keep.py" not in z.namelist()
        assert "ray/rllib/algo.py" in z.namelist()
    broken = tmp_path / "broken.whl"
    with zipfile.ZipFile(broken, "w") as z:
        z.writestr("pkg/a.py", b"")
    with pytest.raises(ValueError, match="0 top-level RECORD files"):
        slim_wheel.slim(broken, ("pkg/b",))
    assert len(list(tmp_path.glob("tmp*.whl"))) == 0  # no temporary file left behind
