"""What to tell an operator when a store refuses a request with a 403 while the credentials
themselves are fine (other requests work): the permission the request needs. Shared by both S3
drivers and the GCS and Azure stores, so that a refused delete (retention, ``tierckpt gc``, a
lease's release) names ``s3:DeleteObject`` instead of sending the reader to check credentials
that work."""

from __future__ import annotations

__all__ = ["AUTH_CODES", "delete_denied_hint"]

#: the store's codes that say the credentials themselves are wrong (not a missing permission)
AUTH_CODES = frozenset(
    {
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "TokenRefreshRequired",
        "AuthenticationFailed",  # Azure
        "InvalidAuthenticationInfo",  # Azure
    }
)

#: per URL scheme, the permission a delete needs
_DELETE_PERMISSION = {
    "s3": "s3:DeleteObject",
    "gs": "storage.objects.delete",
    "az": "delete on blobs (Storage Blob Data Contributor)",
}


def delete_denied_hint(scheme: str, url: str) -> str:
    """The hint for a delete under ``url`` (``scheme://bucket/prefix``) refused with 403."""
    perm = _DELETE_PERMISSION.get(scheme, "the delete permission")
    return (
        f"these credentials may not delete under {url}: grant {perm} on {url}/* "
        "(retention, tierckpt gc and the writer lease's release delete objects there), or set "
        "keep_last=None on the tier to stop its retention deleting"
    )
