"""The fast kernels' cache (split from test_fast_paths.py): private to the user, and a library is loaded only if it
is ours — a planted library (another owner, a world-writable folder, a symlink) is refused."""

from __future__ import annotations

import os
import shutil

import pytest

from gradcompress.codecs import fast


# --------------------------------------------------------------------------- the cache: private, checked
@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """One fresh build (compiling takes seconds) in a new cache root: (root, library path)."""
    if fast._compiler() is None:
        pytest.skip("no compiler")
    root = tmp_path_factory.mktemp("built") / "cache"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(fast.CACHE_ENV, str(root))
        return root, fast._build(fast._compiler())


def _rebuild(monkeypatch, root):
    monkeypatch.setenv(fast.CACHE_ENV, str(root))
    return fast._build(fast._compiler())


def _copy_of(built, root):
    """The built cache copied to root (modes kept): a cache as a fresh build leaves it, without compiling."""
    shutil.copytree(built[0], root, copy_function=shutil.copy2)
    return root / built[1].relative_to(built[0])


def test_cache_is_private_and_the_library_is_ours(monkeypatch, built):
    root, path = built
    assert path.parent.parent == root
    for p in (path.parent.parent, path.parent):
        assert os.stat(p).st_mode & 0o777 == 0o700
    st = os.stat(path)
    assert st.st_uid == os.getuid() and not st.st_mode & 0o022
    mtime = st.st_mtime_ns
    assert _rebuild(monkeypatch, root) == path  # found again, not rebuilt
    assert os.stat(path).st_mtime_ns == mtime


@pytest.mark.parametrize("attack", ["foreign owner", "world-writable folder", "symlink"])
def test_planted_library_is_not_loaded(monkeypatch, tmp_path, built, attack):
    if attack == "foreign owner" and os.getuid() != 0:
        pytest.skip("chown to another user needs root")
    root = tmp_path / "cache"
    path = _copy_of(built, root)
    assert _rebuild(monkeypatch, root) == path  # the copy is a valid cache before the attack
    planted = tmp_path / "planted.so"
    planted.write_bytes(b"not a library")
    if attack == "foreign owner":
        os.chown(path, 65534, 65534)  # another user's file at the predictable path
    elif attack == "world-writable folder":
        os.chmod(root, 0o777)
    else:
        path.unlink()
        path.symlink_to(planted)
    with pytest.raises(RuntimeError, match="owned by uid 65534|writable by other users|symbolic link"):
        fast.check_private(path, "file") if attack != "world-writable folder" else fast.check_private(root)
    chosen = _rebuild(monkeypatch, root)  # skips the unsafe place: the private temp fallback instead
    assert chosen != path and chosen.parent.parent.name == f"gradcompress-{os.getuid()}"


def test_build_raises_with_the_reason(monkeypatch):
    monkeypatch.setattr(fast, "_lib", None)
    monkeypatch.setattr(fast, "_failure", None)
    monkeypatch.setattr(fast, "_compiler", lambda: None)
    with pytest.warns(RuntimeWarning):
        with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
            fast.build_kernels()
