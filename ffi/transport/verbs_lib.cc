#include "transport/verbs_lib.h"

#if ARX_HAVE_VERBS

#include <dlfcn.h>

#include <cerrno>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

namespace arx::verbs {
namespace {

std::once_flag g_once;
Status g_status;
Api g_api;

// Binds `slot` to name@version; a missing symbol is added to `missing`.
template <typename F>
void bind(void* lib, F& slot, const char* name, const char* version, std::string& missing) {
  void* p = dlvsym(lib, name, version);
  if (!p) missing += strf("%s%s@%s", missing.empty() ? "" : ", ", name, version);
  slot = reinterpret_cast<F>(p);
}

void load_once(const std::string& lib_name) {
  std::vector<std::string> names;
  if (!lib_name.empty())
    names.push_back(lib_name);  // an explicit choice: no silent fallback past it
  else
    names = {"libibverbs.so.1", "libibverbs.so"};
  void* lib = nullptr;
  std::string tried, loaded;
  for (const std::string& name : names) {
    lib = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (lib) {
      loaded = name;
      break;
    }
    const char* e = dlerror();
    tried += strf("%s%s (%s)", tried.empty() ? "" : ", ", name.c_str(), e ? e : "not found");
  }
  if (!lib) {
    g_status = Status::Error(
        strf("jax_arx: the verbs carrier could not load libibverbs: tried %s. Install rdma-core's libibverbs1 and "
             "ibverbs-providers (Debian/Ubuntu; rdma-core on RHEL), point JAX_ARX_IBVERBS_LIB at the library, or set "
             "JAX_ARX_TRANSPORT=tcp",
             tried.c_str()));
    return;
  }
  // Every one of these has carried IBVERBS_1.1 since rdma-core's first
  // release; 1.0 is the pre-2006 ABI with other struct layouts.
  const char* v = "IBVERBS_1.1";
  std::string missing;
  Api& a = g_api;
  bind(lib, a.get_device_list, "ibv_get_device_list", v, missing);
  bind(lib, a.free_device_list, "ibv_free_device_list", v, missing);
  bind(lib, a.get_device_name, "ibv_get_device_name", v, missing);
  bind(lib, a.open_device, "ibv_open_device", v, missing);
  bind(lib, a.close_device, "ibv_close_device", v, missing);
  bind(lib, a.query_device, "ibv_query_device", v, missing);
  bind(lib, a.query_port, "ibv_query_port", v, missing);
  bind(lib, a.query_gid, "ibv_query_gid", v, missing);
  bind(lib, a.alloc_pd, "ibv_alloc_pd", v, missing);
  bind(lib, a.dealloc_pd, "ibv_dealloc_pd", v, missing);
  bind(lib, a.reg_mr, "ibv_reg_mr", v, missing);
  bind(lib, a.dereg_mr, "ibv_dereg_mr", v, missing);
  bind(lib, a.create_cq, "ibv_create_cq", v, missing);
  bind(lib, a.destroy_cq, "ibv_destroy_cq", v, missing);
  bind(lib, a.create_qp, "ibv_create_qp", v, missing);
  bind(lib, a.modify_qp, "ibv_modify_qp", v, missing);
  bind(lib, a.destroy_qp, "ibv_destroy_qp", v, missing);
  bind(lib, a.wc_status_str, "ibv_wc_status_str", v, missing);
  if (!missing.empty()) {
    // The library stays loaded: unloading a half-used libibverbs is not safe.
    g_status =
        Status::Error(strf("jax_arx: the libibverbs that was loaded (%s) lacks %s; it is older than "
                           "rdma-core or not libibverbs at all. Check JAX_ARX_IBVERBS_LIB, or set "
                           "JAX_ARX_TRANSPORT=tcp",
                           loaded.c_str(), missing.c_str()));
  }
}

}  // namespace

Status load(const std::string& lib, const Api*& out) {
  std::call_once(g_once, load_once, lib);
  out = g_status.ok() ? &g_api : nullptr;
  return g_status;
}

int query_port(const Api& api, ibv_context* ctx, uint8_t port, ibv_port_attr* attr) {
  if (verbs_context* vctx = verbs_get_ctx_op(ctx, query_port)) return vctx->query_port(ctx, port, attr, sizeof(*attr));
  memset(attr, 0, sizeof(*attr));
  return api.query_port(ctx, port, reinterpret_cast<_compat_ibv_port_attr*>(attr));
}

std::string error_text(int rc) {
  const int e = rc > 0 ? rc : errno;
  return strf("%s (errno %d)", e ? strerror(e) : "unknown error", e);
}

}  // namespace arx::verbs

#endif  // ARX_HAVE_VERBS
