// A set of std::threads that are all joined when it goes out of scope, whatever the path.
// A std::thread destroyed while joinable calls std::terminate ("terminate called without an
// active exception"), and a thread still running would touch its caller's freed locals.
#pragma once

#include <thread>
#include <utility>
#include <vector>

namespace grouped_ep {

class JoinAll {
 public:
  explicit JoinAll(size_t n) { threads_.reserve(n); }
  ~JoinAll() {
    for (auto& t : threads_) {
      if (t.joinable()) t.join();
    }
  }
  JoinAll(const JoinAll&) = delete;
  JoinAll& operator=(const JoinAll&) = delete;
  // Starts f on a new thread; throws std::system_error when no thread can be had.
  template <class F, class... Args>
  void start(F&& f, Args&&... args) {
    threads_.emplace_back(std::forward<F>(f), std::forward<Args>(args)...);
  }

 private:
  std::vector<std::thread> threads_;
};

}  // namespace grouped_ep
