// A non-owning reference to a callable, for "call this during the call" parameters (thread pool jobs, rank
// functions). Unlike std::function it never copies the callable, so it never allocates, however much the
// lambda captures; the callable must outlive every call through the reference (true for an argument used
// only until the callee returns).
#pragma once

#include <functional>
#include <memory>
#include <type_traits>
#include <utility>

namespace memra {

template <class Signature>
class FunctionRef;

template <class R, class... Args>
class FunctionRef<R(Args...)> {
public:
    template <class F>
        requires(!std::is_same_v<std::remove_cvref_t<F>, FunctionRef> && std::is_invocable_r_v<R, F &, Args...>)
    FunctionRef(F &&f) noexcept  // NOLINT(google-explicit-constructor): stands in for a callable argument
        : object_(const_cast<void *>(static_cast<const void *>(std::addressof(f)))),
          call_([](void *object, Args... args) -> R {
              return std::invoke(*static_cast<std::remove_reference_t<F> *>(object), std::forward<Args>(args)...);
          }) {}

    R operator()(Args... args) const { return call_(object_, std::forward<Args>(args)...); }

private:
    void *object_;
    R (*call_)(void *, Args...);
};

}  // namespace memra
