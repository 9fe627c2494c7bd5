// Copyright mstar-kv authors.
//
// Umbrella header: everything a user of mstar-kv touches. Not here: the
// engines' own classes but local_only (the manager picks engines by name),
// and the test pattern (pattern.hpp: no library header includes a test
// helper; whoever fills or verifies a pattern includes it).
#pragma once

#include "mstar/kv/cache.hpp"
#include "mstar/kv/descriptor.hpp"
#include "mstar/kv/engine.hpp"
#include "mstar/kv/engine_options.hpp"
#include "mstar/kv/factory.hpp"
#include "mstar/kv/future.hpp"
#include "mstar/kv/layout.hpp"
#include "mstar/kv/local_only.hpp"
#include "mstar/kv/log.hpp"
#include "mstar/kv/manager.hpp"
#include "mstar/kv/planner.hpp"
#include "mstar/kv/pool.hpp"
#include "mstar/kv/read_info.hpp"
#include "mstar/kv/readiness.hpp"
#include "mstar/kv/regions.hpp"
#include "mstar/kv/requests.hpp"
#include "mstar/kv/stats.hpp"
#include "mstar/kv/status.hpp"
#include "mstar/kv/streaming.hpp"
