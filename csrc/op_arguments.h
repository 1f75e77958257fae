#pragma once

// The op schemas' arguments, written from the argument structs (attention_arguments.h) and read
// back from the dispatcher's stack by the boxed kernels in register_ops.cpp: each struct's
// for_each_field is the one list of its members, in schema order.

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <algorithm>
#include <initializer_list>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

namespace torchmha::ops {

/// ", decl, decl, ..." for every member of Args, as its for_each_field declares them; the members
/// named in `read_only` without their alias annotation ("Tensor(a!) keys" as "Tensor keys"), for an
/// op that reads, or does not touch, what another op of the same struct writes.
template <typename Args>
std::string declarations(std::initializer_list<std::string_view> read_only = {}) {
  std::string out;
  Args().for_each_field([&](const char* declaration, auto&) {
    std::string field = declaration;
    const std::string_view name = std::string_view(field).substr(field.rfind(' ') + 1);
    if (std::find(read_only.begin(), read_only.end(), name) != read_only.end() && field.find('(') != std::string::npos) {
      field.erase(field.find('('), field.find(')') - field.find('(') + 1);
    }
    out += ", ";
    out += field;
  });
  return out;
}

/// A boxed kernel's view of its op's arguments on the stack, read front to back in schema order.
class StackArguments {
 public:
  StackArguments(const c10::OperatorHandle& op, torch::jit::Stack* stack)
      : stack_(*stack), count_(op.schema().arguments().size()), next_(stack->size() - count_) {}

  template <typename T>
  T next() {
    return std::move(stack_[next_++]).to<T>();
  }

  template <typename Args>
  Args next_struct() {
    Args args;
    args.for_each_field([&](const char*, auto& member) { member = next<std::decay_t<decltype(member)>>(); });
    return args;
  }

  /// Replaces the arguments on the stack by the op's results.
  template <typename... Results>
  void finish(Results&&... results) {
    torch::jit::drop(stack_, count_);
    torch::jit::push(stack_, std::forward<Results>(results)...);
  }

 private:
  torch::jit::Stack& stack_;
  size_t count_, next_;
};

}  // namespace torchmha::ops
