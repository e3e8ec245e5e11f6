#include "replayed_records.h"

#include <c10/core/StorageImpl.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <c10/util/intrusive_ptr.h>

#include <mutex>
#include <unordered_map>

namespace torch_opaque::detail {
namespace {

struct Entry {
  c10::weak_intrusive_ptr<c10::StorageImpl> storage;
  ForwardRecord record;
};

struct Table {
  std::mutex mutex;
  std::unordered_map<const c10::StorageImpl*, Entry> entries;
  size_t purge_at = 64;  // entries whose storage died are dropped at this size
};

Table& table() {
  static Table* t = new Table();  // (never destroyed: used until exit)
  return *t;
}

const c10::StorageImpl* storage_of(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage()) return nullptr;
  return t.storage().unsafeGetStorageImpl();
}

} // namespace

bool keeps_records(const at::Tensor& first_output) {
  if (c10::impl::TorchDispatchModeTLS::stack_len() == 0) return false;
  static const c10::DispatchKeySet traced(
      {c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot,
       c10::DispatchKey::Functionalize, c10::DispatchKey::FuncTorchGradWrapper,
       c10::DispatchKey::FuncTorchBatched, c10::DispatchKey::Batched});
  return storage_of(first_output) != nullptr && !first_output.key_set().has_any(traced);
}

void remember_record(const at::Tensor& first_output, const ForwardRecord& record) {
  const c10::StorageImpl* key = storage_of(first_output);
  if (!key) return;
  Table& t = table();
  std::lock_guard<std::mutex> lock(t.mutex);
  if (t.entries.size() >= t.purge_at) {
    for (auto it = t.entries.begin(); it != t.entries.end();) {
      it = it->second.storage.expired() ? t.entries.erase(it) : std::next(it);
    }
    t.purge_at = std::max<size_t>(64, 2 * t.entries.size());
  }
  c10::weak_intrusive_ptr<c10::StorageImpl> weak(first_output.storage().getWeakStorageImpl());
  t.entries.insert_or_assign(key, Entry{std::move(weak), record});
}

std::optional<ForwardRecord> replayed_record(const at::Tensor& first_output) {
  const c10::StorageImpl* key = storage_of(first_output);
  if (!key) return std::nullopt;
  Table& t = table();
  std::lock_guard<std::mutex> lock(t.mutex);
  auto it = t.entries.find(key);
  if (it == t.entries.end() || it->second.storage.expired()) return std::nullopt;
  return it->second.record;
}

} // namespace torch_opaque::detail
