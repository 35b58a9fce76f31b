// The model's tensors: value and gradient buffers with the parameterization rule of each.
#pragma once
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "moka/error.hpp"
#include "moka/tensor.hpp"
#include "train/parameterization.hpp"

namespace moka::train {

template <typename T>
constexpr DType dtype_of() {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double> || std::is_same_v<T, int32_t>);
  if constexpr (std::is_same_v<T, double>) return DType::f64;
  if constexpr (std::is_same_v<T, int32_t>) return DType::i32;
  return DType::f32;
}

template <typename T>
struct Param {
  TensorRule rule;
  std::vector<T> value, grad;
  const std::string& name() const { return rule.spec.name; }
  TensorView view(std::initializer_list<int64_t> dims) { return TensorView(value.data(), dtype_of<T>(), dims); }
  TensorView grad_view(std::initializer_list<int64_t> dims) { return TensorView(grad.data(), dtype_of<T>(), dims); }
};

template <typename T>
class ParamStore {
 public:
  explicit ParamStore(const std::vector<TensorRule>& rules) {
    for (const auto& r : rules) {
      const auto n = static_cast<size_t>(r.spec.numel());
      params_.push_back({r, std::vector<T>(n), std::vector<T>(n)});
    }
  }

  // Each tensor draws from its own stream (seed, name), so adding a tensor changes no other.
  void initialize(uint64_t seed) {
    for (auto& p : params_) {
      if (p.rule.init_ones) {
        std::fill(p.value.begin(), p.value.end(), T(1));
        continue;
      }
      std::mt19937_64 rng(seed ^ std::hash<std::string>{}(p.name()));
      std::normal_distribution<double> normal(0.0, p.rule.init_std);
      for (auto& v : p.value) v = static_cast<T>(normal(rng));
    }
  }

  void zero_grads() {
    for (auto& p : params_) std::fill(p.grad.begin(), p.grad.end(), T(0));
  }

  size_t size() const { return params_.size(); }
  Param<T>& operator[](size_t i) { return params_[i]; }
  const Param<T>& operator[](size_t i) const { return params_[i]; }
  Param<T>& at(const std::string& name) { return params_[index(name)]; }
  size_t index(const std::string& name) const {
    for (size_t i = 0; i < params_.size(); ++i)
      if (params_[i].name() == name) return i;
    throw Error(ErrorCode::invalid_argument, "the model has no tensor '" + name + "'");
  }
  auto begin() { return params_.begin(); }
  auto end() { return params_.end(); }
  auto begin() const { return params_.begin(); }
  auto end() const { return params_.end(); }

 private:
  std::vector<Param<T>> params_;
};

}  // namespace moka::train
