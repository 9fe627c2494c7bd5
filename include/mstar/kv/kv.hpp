// Copyright mstar-kv authors.
//
// Umbrella header: everything a user of mstar-kv touches. Not here: the
// engines' own classes but local_only (engines/: the manager picks engines by
// name), and the test pattern (testing/pattern.hpp: no library header
// includes a test helper; whoever fills or verifies a pattern includes it).
#pragma once

#include "mstar/kv/core/cache.hpp"
#include "mstar/kv/core/descriptor.hpp"
#include "mstar/kv/core/engine.hpp"
#include "mstar/kv/core/engine_options.hpp"
#include "mstar/kv/core/future.hpp"
#include "mstar/kv/core/layout.hpp"
#include "mstar/kv/core/planner.hpp"
#include "mstar/kv/core/pool.hpp"
#include "mstar/kv/core/read_info.hpp"
#include "mstar/kv/core/readiness.hpp"
#include "mstar/kv/core/regions.hpp"
#include "mstar/kv/core/requests.hpp"
#include "mstar/kv/core/stats.hpp"
#include "mstar/kv/engines/local_only.hpp"
#include "mstar/kv/factory.hpp"
#include "mstar/kv/manager.hpp"
#include "mstar/kv/streaming.hpp"
#include "mstar/kv/util/log.hpp"
#include "mstar/kv/util/status.hpp"
