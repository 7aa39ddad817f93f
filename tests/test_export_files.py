"""Exported weights are readable like the files written next to them."""
import os
import stat

from ba_jax.policy import hf
from model_utils import save_tiny_model


def _mode(path):
  return stat.S_IMODE(os.stat(path).st_mode)


def test_exported_safetensors_have_the_same_mode_as_config(tmp_path):
  old_umask = os.umask(0o022)
  try:
    src = save_tiny_model("qwen2", tmp_path / "src", with_tokenizer=False)
    model, config = hf.load_pretrained(src)
    hf.save_pretrained(model, config, tmp_path / "one")
    hf.save_pretrained(model, config, tmp_path / "many", max_shard_size="40KB")
  finally:
    os.umask(old_umask)
  assert _mode(tmp_path / "one" / "config.json") == 0o644
  assert _mode(tmp_path / "one" / hf.SAFETENSORS) == 0o644
  shards = sorted((tmp_path / "many").glob("model-*.safetensors"))
  assert len(shards) > 1 and {_mode(p) for p in shards} == {0o644}
