// Torch storages in segments (Note [Tensor storages] in tensors.h).
#include "tensors.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <utility>

#include "gil.h"
#include "message.h"
#include "stats.h"
#include "views.h"

namespace torchshm {

namespace {

// This process's storage over each segment that has one, held weakly, by
// segment name. Touched only under the GIL. Dead entries are dropped
// whenever the table doubled since the last pass.
class SegmentStorages {
 public:
  at::Storage get(const std::string& name) const {
    auto found = table_.find(name);
    if (found == table_.end()) return at::Storage();
    c10::intrusive_ptr<c10::StorageImpl> live = found->second.lock();
    return live ? at::Storage(std::move(live)) : at::Storage();
  }

  void remember(const std::string& name, const at::Storage& storage) {
    table_.insert_or_assign(name, storage.getWeakStorageImpl());
    if (table_.size() <= prune_at_) return;
    for (auto it = table_.begin(); it != table_.end();)
      it = it->second.expired() ? table_.erase(it) : std::next(it);
    prune_at_ = std::max<size_t>(64, 2 * table_.size());
  }

 private:
  std::unordered_map<std::string, c10::weak_intrusive_ptr<c10::StorageImpl>>
      table_;
  size_t prune_at_ = 64;
};

SegmentStorages& segment_storages() {
  static auto* storages = new SegmentStorages();  // never destroyed: exit
  return *storages;
}

}  // namespace

void move_storage(const at::Tensor& tensor, const at::Tensor& owner,
                  int threads) {
  const std::shared_ptr<Segment> segment = checked_view(owner).segment;
  at::Storage storage = tensor.storage();
  TORCH_CHECK(view_of(storage) == nullptr,
              "the storage is in a torchshm segment already");
  const int64_t n = static_cast<int64_t>(storage.nbytes());
  TORCH_CHECK(n <= segment->capacity(), "a storage of ", n,
              " bytes does not fit a segment of ", segment->capacity());
  const auto* src = static_cast<const uint8_t*>(storage.data());
  {
    // The caller holds the storage, and its policy lock keeps any other
    // thread from moving it meanwhile (torch/_send/tensors.py).
    GilReleased no_gil;  // Note [The GIL at exit] in gil.h
    segment->fill(0, src, n, threads);
  }
  c10::StorageImpl* impl = storage.unsafeGetStorageImpl();
  // What torch's share_memory_() does with its /dev/shm file: every tensor
  // over this storage sees the segment from now on; the old bytes are freed
  // when `old` goes.
  at::DataPtr old = impl->set_data_ptr(shared_alias(owner));
  impl->set_resizable(false);
  impl->set_allocator(nullptr);
  segment_storages().remember(segment->name(), storage);
  count(kStoragesMoved);
  count(kBytesCopied, n);
}

at::Tensor segment_storage(const at::Tensor& owner, int64_t nbytes) {
  const View& view = checked_view(owner);
  const std::shared_ptr<Segment>& segment = view.segment;
  // One storage per segment over its shared mapping; one per message over
  // a snapshot's private mapping (the mapping's address names the message:
  // it is not lent again while a storage over it lives).
  std::string key = segment->name();
  if (view.lease != nullptr)
    key += "@" + std::to_string(reinterpret_cast<uintptr_t>(view.lease->data));
  at::Storage live = segment_storages().get(key);
  if (live && static_cast<int64_t>(live.nbytes()) == nbytes)
    return tensor_of(std::move(live));
  TORCH_CHECK(0 <= nbytes && nbytes <= segment->capacity(), "a storage of ",
              nbytes, " bytes does not fit a segment of ", segment->capacity());
  at::Storage storage(at::Storage::use_byte_size_t(), nbytes,
                      storage_alias(owner), /*allocator=*/nullptr,
                      /*resizable=*/false);
  segment_storages().remember(key, storage);
  return tensor_of(std::move(storage));
}

void snapshot_storage(const at::Tensor& tensor, const at::Tensor& owner,
                      int threads) {
  const std::shared_ptr<Segment> segment = checked_view(owner).segment;
  at::Storage storage = tensor.storage();
  const int64_t n = static_cast<int64_t>(storage.nbytes());
  TORCH_CHECK(n <= segment->capacity(), "a storage of ", n,
              " bytes does not fit a segment of ", segment->capacity());
  const auto* src = static_cast<const uint8_t*>(storage.data());
  {
    GilReleased no_gil;  // Note [The GIL at exit] in gil.h
    segment->fill(0, src, n, threads);
  }
  segment->mark_snapshot();
  count(kStoragesCopied);
  count(kBytesCopied, n);
}

bool storage_written(const at::Tensor& tensor) {
  const View* view = view_of(tensor);
  return view != nullptr &&
         written_privately(view, 0,
                           static_cast<int64_t>(tensor.storage().nbytes()));
}

py::object message_ref(py::handle owner) {
  const View& view = checked_view(unpack_tensor(owner));
  py::object message = current_message();
  count(kStoragesSent);
  return message.cast<Message&>().ref(message,
                                      py::reinterpret_borrow<py::object>(owner),
                                      py::str(view.segment->name()));
}

}  // namespace torchshm
