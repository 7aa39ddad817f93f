"""An offline stand-in for gs:// buckets: fsspec's "gcs" protocol (what
``etils.epath`` uses for gs:// paths) served from a local directory."""
import fsspec
from fsspec.implementations.local import LocalFileSystem


class FakeGCS(LocalFileSystem):
  """gs://bucket/key -> ``FakeGCS.root``/bucket/key."""
  root = None  # set by install()
  protocol = ("gcs", "gs")
  cachable = False

  def __init__(self, *args, finalize_on_close=False, **kwargs):
    super().__init__(*args, **kwargs)

  @classmethod
  def _strip_protocol(cls, path):
    path = str(path)
    for prefix in ("gs://", "gcs://"):
      if path.startswith(prefix):
        return f"{cls.root}/{path[len(prefix):]}".rstrip("/")
    return super()._strip_protocol(path)

  def unstrip_protocol(self, name):
    return "gs://" + name[len(self.root) + 1:]


def install(root: str) -> None:
  """Routes gs:// (through fsspec) to ``root`` from now on."""
  FakeGCS.root = str(root)
  for name in ("gcs", "gs"):
    fsspec.register_implementation(name, FakeGCS, clobber=True)


def local_path(url: str) -> str:
  """Where the fake bucket keeps ``url``."""
  return FakeGCS._strip_protocol(url)
