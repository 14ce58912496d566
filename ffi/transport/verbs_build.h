// Whether this build has the verbs carrier (rdma-core's headers at build
// time): ARX_HAVE_VERBS, 1 or 0, set by CMakeLists.txt on the sources that
// test it (ARX_VERBS_SOURCES) and on no other, so that the others compile
// alike with and without it. Every source or header that tests it includes
// this first: one that is not listed there fails here, instead of reading
// the verbs types' layout as absent while a listed one reads it present.
#pragma once

#ifndef ARX_HAVE_VERBS
#error "ARX_HAVE_VERBS is not set: list this source in CMakeLists.txt's ARX_VERBS_SOURCES"
#endif
