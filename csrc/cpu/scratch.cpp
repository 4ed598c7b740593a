// The list of every thread's kernel scratch (see ScratchSlot in aligned_buffer.h).
#include <pthread.h>

#include <algorithm>
#include <mutex>
#include <vector>

#include "aligned_buffer.h"

namespace grouped_ep {
namespace {

struct Registry {
  std::mutex m;
  std::vector<ScratchSlot*> slots;
};

// Never destroyed: the main thread's scratch leaves the list after static destructors ran. Held
// across fork(), so that a child never starts with the list locked by a thread it lacks.
Registry& registry() {
  static Registry* r = [] {
    auto* made = new Registry;
    pthread_atfork([] { registry().m.lock(); }, [] { registry().m.unlock(); }, [] { registry().m.unlock(); });
    return made;
  }();
  return *r;
}

}  // namespace

void ScratchSlot::list() {
  Registry& r = registry();
  std::lock_guard<std::mutex> hold(r.m);
  r.slots.push_back(this);
}

void ScratchSlot::unlist() {
  Registry& r = registry();
  std::lock_guard<std::mutex> hold(r.m);
  r.slots.erase(std::remove(r.slots.begin(), r.slots.end(), this), r.slots.end());
}

int64_t release_every_scratch() {
  Registry& r = registry();
  std::lock_guard<std::mutex> hold(r.m);
  int64_t bytes = 0;
  for (ScratchSlot* slot : r.slots) {
    std::unique_lock<std::mutex> idle(slot->in_use, std::try_to_lock);
    if (idle.owns_lock()) bytes += static_cast<int64_t>(slot->release());
  }
  return bytes;
}

}  // namespace grouped_ep
