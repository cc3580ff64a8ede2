// The Loom plugin SDK: header-only C++20 on top of the C ABI in <loom/abi.h>.
// Plugins include this header and, for each kind they provide, loom/sdk/kinds/NAME.hpp (the
// kinds of SDK 1.5 also come through plugin.hpp, a frozen list); docs/sdk.md is the guide.
#ifndef LOOM_SDK_HPP
#define LOOM_SDK_HPP

#include <loom/sdk/abi_array.hpp>
#include <loom/sdk/comm.hpp>
#include <loom/sdk/context.hpp>
#include <loom/sdk/parallel.hpp>
#include <loom/sdk/plugin.hpp>
#include <loom/sdk/quant_format.hpp>
#include <loom/sdk/schema.hpp>
#include <loom/sdk/state.hpp>
#include <loom/sdk/status.hpp>
#include <loom/sdk/tensor.hpp>

#endif  // LOOM_SDK_HPP
