"""File-system state survives checkpoint -> kill -> restore: creations, edits, deletions, modes, xattrs."""

from __future__ import annotations

from conftest import DEBIAN

from belayer_envckpt import CheckpointStore, full_checkpoint, full_restore

# Files and attributes as Python sees them inside the container, so the same probe runs before
# the checkpoint and after the restore.
PROBE = r"""
import os, json, stat
out = {}
for root in ('/work', '/etc/apt', '/usr/share/doc/git'):
    if not os.path.exists(root):
        out[root] = None
        continue
    for dirpath, dirs, files in os.walk(root):
        for name in sorted(dirs + files):
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            entry = {'mode': stat.filemode(st.st_mode), 'uid': st.st_uid, 'gid': st.st_gid}
            if stat.S_ISREG(st.st_mode):
                entry['data'] = open(p, 'rb').read().hex()
            if stat.S_ISLNK(st.st_mode):
                entry['link'] = os.readlink(p)
            try:
                entry['xattrs'] = {k: os.getxattr(p, k, follow_symlinks=False).hex()
                                   for k in sorted(os.listxattr(p, follow_symlinks=False)) if k.startswith('user.')}
            except OSError:
                pass
            out[p] = entry
print(json.dumps(out, sort_keys=True))
"""

CHANGES = r"""
set -e
mkdir -p /work/sub/deeper
printf 'hello\n' > /work/new.txt
echo 'secret' > /work/sub/deeper/private && chmod 0640 /work/sub/deeper/private
chown 1234:5678 /work/sub/deeper/private
chmod 4755 /work/sub && ln -s new.txt /work/link
python3 -c "import os; os.setxattr('/work/new.txt', 'user.belayer', b'prefix-k')"
echo 'edited' >> /etc/apt/sources.list.d/extra.list
rm -f /etc/apt/apt.conf.d/01autoremove
rm -rf /usr/share/doc/git && mkdir -p /usr/share/doc/git && echo 'only me' > /usr/share/doc/git/README
"""


def test_file_state_round_trips(make_sandbox, track, engine, tmp_path):
    sandbox = make_sandbox(DEBIAN, "fs")
    assert sandbox.exec(CHANGES).exit_code == 0
    before = sandbox.exec(["python3", "-c", PROBE]).stdout
    store = CheckpointStore(tmp_path)
    ckpt = full_checkpoint(sandbox, "fs", store=store)
    sandbox.exec("rm -rf /work; echo junk > /etc/apt/apt.conf.d/01autoremove")
    sandbox.kill()

    restored = track(full_restore(ckpt, engine=engine))
    after = restored.exec(["python3", "-c", PROBE]).stdout
    assert after == before
    # The deletion is a whiteout and the recreated directory is opaque: the image's files under
    # it must not show through.
    assert restored.exec("test -e /etc/apt/apt.conf.d/01autoremove").exit_code == 1
    assert restored.exec("ls /usr/share/doc/git").stdout.split() == ["README"]
    assert restored.exec("stat -c %u:%g:%a /work/sub/deeper/private").stdout.strip() == "1234:5678:640"


def test_failed_instance_is_never_reused(make_sandbox, track, engine, tmp_path):
    sandbox = make_sandbox(trajectory="fresh")
    sandbox.exec("echo a > /work/a")
    ckpt = full_checkpoint(sandbox, "fresh", store=CheckpointStore(tmp_path))
    sandbox.kill()
    restored = track(full_restore(ckpt, engine=engine))
    assert restored.id != sandbox.id
    assert sandbox.status() == "removed"
    assert restored.status() == "running"
    assert restored.exec("cat /work/a").stdout == "a\n"
