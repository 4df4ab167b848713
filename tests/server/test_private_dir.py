"""The server's private directories (server/private_dir.py): orphans of a dead master removed at
the next start, a live owner's kept."""
from __future__ import annotations


def test_private_dir_orphans_are_removed_and_live_ones_kept(tmp_path):
    """A private directory whose master died (its .owner flock is free) goes at the next start;
    one whose owner holds the lock stays; so does an ownerless one a moment old, and another
    prefix's."""
    import fcntl

    from server import private_dir
    from server.gunicorn_conf import RESPONSES_DIR_PREFIX
    from server.observability import metrics_dir

    dead, live, young = (tmp_path / f"{metrics_dir.PREFIX}{n}" for n in ("dead", "live", "young"))
    other = tmp_path / f"{RESPONSES_DIR_PREFIX}dead"
    for d in (dead, live, young, other):
        d.mkdir()
        (d / "responses.db").touch()
    for d in (dead, other):
        (d / ".owner").touch()
    owner = open(live / ".owner", "w")
    fcntl.flock(owner, fcntl.LOCK_EX)
    try:
        assert private_dir.remove_orphans(metrics_dir.PREFIX, str(tmp_path)) == [str(dead)]
        assert live.exists() and young.exists() and other.exists() and not dead.exists()
    finally:
        owner.close()
    assert private_dir.remove_orphans(metrics_dir.PREFIX, str(tmp_path)) == [str(live)]
    created = private_dir.create(RESPONSES_DIR_PREFIX, str(tmp_path))  # removes the dead one first
    assert [p.name for p in (tmp_path / created).iterdir()] == [".owner"]  # renamed into place once locked
    assert not other.exists() and private_dir.remove_orphans(RESPONSES_DIR_PREFIX, str(tmp_path)) == []
    private_dir.remove(created)
    assert not (tmp_path / created).exists()
