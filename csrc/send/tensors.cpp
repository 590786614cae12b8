// Torch storages in segments (Note [Tensor storages] in tensors.h).
#include "send/tensors.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>

#include "base/gil.h"
#include "base/stats.h"
#include "lifetime/slabs.h"
#include "lifetime/views.h"
#include "send/allocator.h"
#include "send/message.h"

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

// What a storage over a block of a slab holds (Note [Small storages]): the
// sender's carved block, or a receiver's storage over the whole slab.
struct BlockStorage {
  std::string name;  // the slab's segment
  int64_t offset;    // of the block in the segment's data
  Slab* slab;        // the sender's: the block goes back to it
  size_t capacity;   // bytes carved
  at::Storage keep;  // a receiver's: the slab's storage (a View's)
};

void delete_block_storage(void* ctx) {
  std::unique_ptr<BlockStorage> block(static_cast<BlockStorage*>(ctx));
  if (block->slab == nullptr) return;  // keep's view needs no GIL to go
  if (interpreter_finalizing() && !PyGILState_Check()) return;
  const PyGILState_STATE gil = PyGILState_Ensure();
  slabs().release(block->slab, block->capacity);
  PyGILState_Release(gil);
}

BlockStorage* block_context(const at::Storage& storage) {
  if (!storage) return nullptr;
  return storage.data_ptr().cast_context<BlockStorage>(&delete_block_storage);
}

std::string block_key(const std::string& name, int64_t offset) {
  return name + "+" + std::to_string(offset);
}

// A DataPtr over a block carved for `nbytes` (the block goes back to its
// slab when the DataPtr is freed), or a null one where no slab can be had.
at::DataPtr carved_data(int64_t nbytes) {
  const Slabs::Block block = carve_block(static_cast<size_t>(nbytes));
  if (block.data == nullptr) return at::DataPtr();
  const at::Tensor& owner = unpack_tensor(Slabs::owner(block.slab));
  const int64_t offset =
      static_cast<uint8_t*>(block.data) -
      static_cast<uint8_t*>(owner.storage().data_ptr().get());
  auto* context = new BlockStorage{checked_view(owner).segment->name(), offset,
                                   block.slab, block.capacity, at::Storage()};
  return at::DataPtr(block.data, context, &delete_block_storage,
                     at::Device(at::kCPU));
}

void remember_block(const at::Storage& storage) {
  const BlockStorage* block = block_context(storage);
  segment_storages().remember(block_key(block->name, block->offset), storage);
}

// Copies all of `storage`'s bytes to the start of `segment`'s data.
void fill_from(Segment& segment, const at::Storage& storage, int threads) {
  const int64_t n = static_cast<int64_t>(storage.nbytes());
  TORCH_CHECK(n <= segment.capacity(), "a storage of ", n,
              " bytes does not fit a segment of ", segment.capacity());
  const auto* src = static_cast<const uint8_t*>(storage.data());
  // The caller holds the storage, and its policy lock keeps any other thread
  // from moving it meanwhile (torchshm/_send/tensors.py).
  GilReleased no_gil;  // Note [The GIL at exit] in gil.h
  segment.fill(0, src, n, threads);
}

// What torch's share_memory_() does with its /dev/shm file: every tensor
// over `storage` sees `data` (holding a copy of its bytes) from now on; the
// old bytes are freed here.
void move_to(const at::Storage& storage, at::DataPtr data) {
  c10::StorageImpl* impl = storage.unsafeGetStorageImpl();
  at::DataPtr old = impl->set_data_ptr(std::move(data));
  impl->set_resizable(false);
  impl->set_allocator(nullptr);
  count(kStoragesMoved);
  count(kBytesCopied, static_cast<int64_t>(storage.nbytes()));
}

}  // namespace

at::Tensor carve_storage(int64_t nbytes) {
  TORCH_CHECK(nbytes > 0, "expected a positive size, got ", nbytes);
  at::DataPtr data = carved_data(nbytes);
  if (!data) return at::Tensor();
  at::Storage storage(at::Storage::use_byte_size_t(), nbytes, std::move(data),
                      /*allocator=*/nullptr, /*resizable=*/false);
  remember_block(storage);
  return tensor_of(std::move(storage));
}

bool move_storage_to_block(const at::Tensor& tensor) {
  at::Storage storage = tensor.storage();
  TORCH_CHECK(view_of(storage) == nullptr && block_context(storage) == nullptr,
              "the storage is in torchshm's memory already");
  const int64_t n = static_cast<int64_t>(storage.nbytes());
  at::DataPtr data = carved_data(n);
  if (!data) return false;
  std::memcpy(data.get(), storage.data(), n);
  move_to(storage, std::move(data));
  remember_block(storage);
  return true;
}

py::object block_of(const at::Tensor& tensor) {
  if (!tensor.defined() || !tensor.has_storage()) return py::none();
  const BlockStorage* block = block_context(tensor.storage());
  if (block == nullptr) return py::none();
  py::object owner =
      block->slab != nullptr
          ? py::reinterpret_borrow<py::object>(Slabs::owner(block->slab))
          : py::cast(tensor_of(block->keep));
  return py::make_tuple(std::move(owner), block->offset);
}

bool in_torchshm_memory(const at::Tensor& tensor) {
  if (!tensor.defined() || !tensor.has_storage()) return false;
  return view_of(tensor) != nullptr ||
         block_context(tensor.storage()) != nullptr;
}

at::Tensor block_storage(const at::Tensor& owner, int64_t offset,
                         int64_t nbytes) {
  const std::shared_ptr<Segment>& segment = checked_view(owner).segment;
  TORCH_CHECK(
      0 < nbytes && 0 <= offset && offset <= segment->capacity() - nbytes,
      "a block of ", nbytes, " bytes at ", offset,
      " does not fit a segment of ", segment->capacity());
  const std::string key = block_key(segment->name(), offset);
  at::Storage live = segment_storages().get(key);
  if (live && static_cast<int64_t>(live.nbytes()) == nbytes)
    return tensor_of(std::move(live));
  at::Storage keep(at::Storage::use_byte_size_t(), segment->capacity(),
                   shared_alias(owner), /*allocator=*/nullptr,
                   /*resizable=*/false);
  uint8_t* data = static_cast<uint8_t*>(keep.data_ptr().get()) + offset;
  auto* context =
      new BlockStorage{segment->name(), offset, nullptr, 0, std::move(keep)};
  at::Storage storage(
      at::Storage::use_byte_size_t(), nbytes,
      at::DataPtr(data, context, &delete_block_storage, at::Device(at::kCPU)),
      /*allocator=*/nullptr, /*resizable=*/false);
  segment_storages().remember(key, storage);
  return tensor_of(std::move(storage));
}

void move_storage(const at::Tensor& tensor, const at::Tensor& owner,
                  int threads) {
  const std::shared_ptr<Segment> segment = checked_view(owner).segment;
  at::Storage storage = tensor.storage();
  TORCH_CHECK(view_of(storage) == nullptr,
              "the storage is in a torchshm segment already");
  fill_from(*segment, storage, threads);
  move_to(storage, shared_alias(owner));
  segment_storages().remember(segment->name(), storage);
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
  const at::Storage storage = tensor.storage();
  fill_from(*segment, storage, threads);
  segment->mark_snapshot();
  count(kStoragesCopied);
  count(kBytesCopied, static_cast<int64_t>(storage.nbytes()));
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
