"""cpp_fakes.key_compile_caches (Note [Compile caches and C++ libraries]):
the digest of the loaded C++ libraries is one ';'-separated part of
torch.compiler.config.cache_key_tag, next to the user's own tag. The
end-to-end case (a rebuilt library under a warm Inductor cache) is
tests/test_cpp_list_ops_compiled.py::test_rebuilt_library_is_not_served_from_inductors_cache."""

import torch

from torch_opaque._impl import cpp_fakes


def test_user_tag_kept_and_digest_replaced_not_repeated(example_ops):
    config = torch.compiler.config
    saved = config.cache_key_tag
    try:
        config.cache_key_tag = "mine"
        cpp_fakes.key_compile_caches()
        first = config.cache_key_tag
        parts = first.split(";")
        assert parts[0] == "mine" and len(parts) == 2
        assert parts[1].startswith("torch_opaque-cpp-libraries:")
        cpp_fakes.key_compile_caches()
        assert config.cache_key_tag == first  # same libraries: same tag, one part
        config.cache_key_tag = "other;" + parts[1]
        cpp_fakes.key_compile_caches()
        assert config.cache_key_tag == "other;" + parts[1]
    finally:
        config.cache_key_tag = saved


def test_digest_follows_the_file_contents(tmp_path, monkeypatch):
    lib = tmp_path / "libx.so"
    lib.write_bytes(b"one")
    monkeypatch.setattr(torch.ops, "loaded_libraries", {str(lib)})
    monkeypatch.setattr(cpp_fakes, "_library_digests", {})
    # (torch's own patch: monkeypatch's undo deletes a config entry it set)
    with torch.compiler.config.patch(cache_key_tag=""):
        cpp_fakes.key_compile_caches()
        before = torch.compiler.config.cache_key_tag
        lib.write_bytes(b"two")  # rebuilt at the same path, loaded by a new process
        monkeypatch.setattr(cpp_fakes, "_library_digests", {})
        cpp_fakes.key_compile_caches()
        assert torch.compiler.config.cache_key_tag != before
