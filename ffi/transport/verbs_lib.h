// libibverbs, loaded at run time (the model is nccl's src/misc/ibvsymbols.cc):
// one build of jax_arx runs with or without rdma-core installed, and a
// machine without RDMA learns so from a clear error, not from the dynamic
// loader refusing to import the module.
//
// rdma-core's headers are needed at build time (ARX_HAVE_VERBS); nothing is
// linked. The verbs on the data path, ibv_post_send and ibv_poll_cq, are
// inline functions in verbs.h that call through the context's ops table, so
// they need no symbol. Beware the verbs.h macros ibv_reg_mr and
// ibv_query_port: call api().reg_mr and verbs::query_port() instead.
#pragma once

#include "transport/verbs_build.h"
#if ARX_HAVE_VERBS

#include <infiniband/verbs.h>

#include "base/status.h"

namespace arx::verbs {

// The symbols jax_arx calls, each bound to the symbol version whose ABI
// these headers describe (IBVERBS_1.1; the 1.0 versions are the old ABI).
struct Api {
  decltype(&::ibv_get_device_list) get_device_list;
  decltype(&::ibv_free_device_list) free_device_list;
  decltype(&::ibv_get_device_name) get_device_name;
  decltype(&::ibv_open_device) open_device;
  decltype(&::ibv_close_device) close_device;
  decltype(&::ibv_query_device) query_device;
  decltype(&::ibv_query_port) query_port;  // the compat entry point; use verbs::query_port()
  decltype(&::ibv_query_gid) query_gid;
  decltype(&::ibv_alloc_pd) alloc_pd;
  decltype(&::ibv_dealloc_pd) dealloc_pd;
  decltype(&::ibv_reg_mr) reg_mr;
  decltype(&::ibv_dereg_mr) dereg_mr;
  decltype(&::ibv_create_cq) create_cq;
  decltype(&::ibv_destroy_cq) destroy_cq;
  decltype(&::ibv_create_qp) create_qp;
  decltype(&::ibv_modify_qp) modify_qp;
  decltype(&::ibv_destroy_qp) destroy_qp;
  decltype(&::ibv_wc_status_str) wc_status_str;
};

// Loads libibverbs once per process (call_once); every later call returns
// the first outcome, whatever `lib` it names. Library names tried: `lib`
// alone when not empty (Config::ibverbs_lib, JAX_ARX_IBVERBS_LIB), else
// libibverbs.so.1, then libibverbs.so.
Status load(const std::string& lib, const Api*& out);

// ibv_query_port as verbs.h's inline wrapper does it (the extended op when
// the provider has one, else the compat symbol on a zeroed attr).
int query_port(const Api& api, ibv_context* ctx, uint8_t port, ibv_port_attr* attr);

// A verb's failure code as text: verbs return an errno value, or -1 and set
// errno (older providers).
std::string error_text(int rc);

}  // namespace arx::verbs

#endif  // ARX_HAVE_VERBS
