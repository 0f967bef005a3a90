"""The object-store driver imports boto3 only where boto3's credential chain must decide: a
save with the keys and region in the environment leaves boto3 unimported (about 0.3 s of every
fresh process), while ``profile=`` still goes through boto3 (issue 15). Retention still lists
a prefix's unfinished multipart uploads through boto3 (obstore has no call for it), so the
subprocess does what a save does up to its commit: the shard's upload and the manifest."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

from tierckpt.testing.s3servers import S3Server

ROOT = Path(__file__).resolve().parents[1]

SAVE = textwrap.dedent(
    """
    import json, sys
    from tierckpt.backends.objstore import ObjectStoreBackend
    url, endpoint, profile = sys.argv[1], sys.argv[2], sys.argv[3] or None
    b = ObjectStoreBackend(url, endpoint_url=endpoint, profile=profile, part_size=5 << 20)
    # what a save does up to its commit: a multipart shard, then the create-only manifest
    w = b.open_writer("steps/000000000001/rank-000000.bin")
    body = bytes(range(256)) * (48 << 12)  # 12 MiB: three parts
    w.write(0, body)
    w.commit()
    b.put_atomic("manifests/step-000000000001.json", b"{}")
    assert b.read("steps/000000000001/rank-000000.bin", 0, len(body)) == body
    assert b.exists("manifests/step-000000000001.json")
    b.close()
    print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in ("boto3", "botocore"))))
    """
)


def _save(server: S3Server, url: str, env: dict[str, str], profile: str = "") -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", SAVE, url, server.endpoint_url, profile],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    loaded: list[str] = json.loads(out.stdout.strip().splitlines()[-1])
    return loaded


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


def test_a_save_up_to_its_commit_with_environment_credentials_does_not_import_boto3(
    seaweedfs_server: S3Server, s3_bucket: Callable[[S3Server], str], tmp_path: Path
) -> None:
    bucket = s3_bucket(seaweedfs_server)
    env = _env(
        AWS_ACCESS_KEY_ID=seaweedfs_server.access_key,
        AWS_SECRET_ACCESS_KEY=seaweedfs_server.secret_key,
        AWS_DEFAULT_REGION=seaweedfs_server.region,
        AWS_CONFIG_FILE=str(tmp_path / "none"),
        AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"),
    )
    assert _save(seaweedfs_server, f"s3://{bucket}/env", env) == []


def test_a_profile_still_resolves_through_boto3(
    seaweedfs_server: S3Server, s3_bucket: Callable[[S3Server], str], tmp_path: Path
) -> None:
    bucket = s3_bucket(seaweedfs_server)
    creds = tmp_path / "credentials"
    creds.write_text(
        f"[ckpt]\naws_access_key_id = {seaweedfs_server.access_key}\n"
        f"aws_secret_access_key = {seaweedfs_server.secret_key}\n"
        f"region = {seaweedfs_server.region}\n"
    )
    env = _env(
        # keys in the environment that are wrong: profile= must win over them, as in botocore
        AWS_ACCESS_KEY_ID="wrong",
        AWS_SECRET_ACCESS_KEY="wrong",
        AWS_DEFAULT_REGION=seaweedfs_server.region,
        AWS_CONFIG_FILE=str(tmp_path / "none"),
        AWS_SHARED_CREDENTIALS_FILE=str(creds),
    )
    assert "boto3" in _save(seaweedfs_server, f"s3://{bucket}/profile", env, profile="ckpt")
