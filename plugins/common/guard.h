// Exception barriers for plugin entry points: no C++ exception may cross the C ABI.
// Header-only (templates); shared by the in-tree storage plugins.
#pragma once

#include <exception>
#include <memory>
#include <string>

#include "kvbridge/plugin/storage.h"

namespace kvbridge::plugin {

// Runs `fn` (returning kvb_status_t); an escaping exception becomes KVB_ERR_INTERNAL and its
// text, prefixed with the plugin's name, goes to err.
template <typename Fn>
kvb_status_t Guard(const char* plugin, Fn&& fn, char* err = nullptr, uint32_t err_len = 0) {
  try {
    return fn();
  } catch (const std::exception& e) {
    kvb_copy_message(err, err_len, (std::string(plugin) + ": internal error: " + e.what()).c_str());
  } catch (...) {
    kvb_copy_message(err, err_len, (std::string(plugin) + ": internal error").c_str());
  }
  return KVB_ERR_INTERNAL;
}

// The create op of a storage plugin whose backend T has
//   static kvb_status_t T::Create(host, params, std::unique_ptr<T>*, std::string* msg).
template <typename T>
kvb_status_t CreateStorage(const char* plugin, const kvb_host_services_t* host,
                           const kvb_storage_params_t* params, kvb_storage_t** out, char* err,
                           uint32_t err_len) {
  return Guard(
      plugin,
      [&]() -> kvb_status_t {
        if (out == nullptr) {
          kvb_copy_message(err, err_len, (std::string(plugin) + ": create: out is null").c_str());
          return KVB_ERR_INVALID_ARGUMENT;
        }
        std::unique_ptr<T> backend;
        std::string msg;
        const kvb_status_t st = T::Create(host, params, &backend, &msg);
        if (st != KVB_OK) {
          kvb_copy_message(err, err_len, msg.c_str());
          return st;
        }
        *out = reinterpret_cast<kvb_storage_t*>(backend.release());
        return KVB_OK;
      },
      err, err_len);
}

}  // namespace kvbridge::plugin
