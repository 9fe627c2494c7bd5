#!/usr/bin/env python3
"""scripts/lib/check_layers.py: the real tree passes, and each broken direction
fails naming the file, the line and the rule (a checker that cannot fail
would hold nothing).

    check_layers_test.py [SOURCE_DIR]   (default: this checkout)
"""
import os
import subprocess
import sys
import tempfile
import unittest

SOURCE_DIR = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
CHECKER = os.path.join(SOURCE_DIR, "scripts", "lib", "check_layers.py")

# A tree with every layer and only allowed includes.
CLEAN = {
    "include/mstar/kv/util/status.hpp": "",
    "include/mstar/kv/core/layout.hpp": '#include "mstar/kv/util/status.hpp"\n',
    "include/mstar/kv/engines/shm.hpp": '#include "mstar/kv/core/layout.hpp"\n',
    "include/mstar/kv/testing/pattern.hpp": '#include "mstar/kv/core/layout.hpp"\n',
    "include/mstar/kv/factory.hpp": '#include "mstar/kv/core/layout.hpp"\n',
    "include/mstar/kv/manager.hpp": '#include "mstar/kv/factory.hpp"\n',
    "include/mstar/kv/kv.hpp": '#include "mstar/kv/manager.hpp"\n',
    "src/util/parse.hpp": '#include "mstar/kv/util/status.hpp"\n',
    "src/core/codec.hpp": '#include "util/parse.hpp"\n',
    "src/core/layout.cpp": '#include "codec.hpp"\n#include "mstar/kv/core/layout.hpp"\n',
    "src/core/pattern.cpp": '#include "mstar/kv/testing/pattern.hpp"\n',
    "src/rma/rma_backend.hpp": '#include "core/codec.hpp"\n',
    "src/engines/engine_makers.hpp": '#include "mstar/kv/core/layout.hpp"\n',
    "src/engines/shm/shm_memory.hpp": "#include <vector>\n",
    "src/engines/shm/shm_engine.cpp": ('#include "shm_memory.hpp"\n'
                                       '#include "engines/engine_makers.hpp"\n'
                                       '#include "mstar/kv/engines/shm.hpp"\n'),
    "src/engines/ucx/ucx_backend.hpp": ('#include "rma/rma_backend.hpp"\n'
                                        '#include "mstar/kv/core/layout.hpp"\n'),
    "src/engines/factory.cpp": ('#include "mstar/kv/factory.hpp"\n'
                                '#include "mstar/kv/engines/shm.hpp"\n'),
    "src/manager/manager.cpp": '#include "mstar/kv/manager.hpp"\n',
    "src/toolkit/child.hpp": '#include "mstar/kv/testing/pattern.hpp"\n',
    "src/testkit/ports.hpp": '#include "toolkit/child.hpp"\n',
    "python/src/module.cpp": '#include "mstar/kv/kv.hpp"\n',
    "tools/mstar-kv/main.cpp": '#include "toolkit/child.hpp"\n#include "mstar/kv/kv.hpp"\n',
    "bench/peers.cpp": '#include "main.hpp"\n#include "testkit/ports.hpp"\n',
    "tools/mstar-kv/main.hpp": "#include <vector>\n",
    "tests/core/layout_test.cpp": '#include "core/codec.hpp"\n#include "mstar/kv/kv.hpp"\n',
}


# Each broken direction: the file of CLEAN that includes what it must not
# (one line added: line 2), then what the checker's report must say.
BREAKS = [
    ("src/engines/ucx/ucx_backend.hpp", "mstar/kv/manager.hpp",
     "src/engines/ucx/ucx_backend.hpp:2:", "mstar/kv/manager.hpp",
     "an engine never includes the manager"),
    ("include/mstar/kv/engines/shm.hpp", "mstar/kv/manager.hpp",
     "include/mstar/kv/engines/shm.hpp:2:", "an engine never includes the manager"),
    ("src/engines/ucx/ucx_backend.hpp", "engines/shm/shm_memory.hpp",
     "src/engines/ucx/ucx_backend.hpp:2:", "engine:ucx includes",
     "an engine includes no other engine"),
    ("src/core/layout.cpp", "mstar/kv/engines/shm.hpp",
     "src/core/layout.cpp:2:", "core includes nothing above it"),
    ("src/util/parse.hpp", "core/codec.hpp",
     "src/util/parse.hpp:2:", "util includes nothing above it"),
    ("include/mstar/kv/kv.hpp", "mstar/kv/testing/pattern.hpp",
     "include/mstar/kv/kv.hpp:2:", "library code includes no test helper"),
    ("include/mstar/kv/core/layout.hpp", "util/parse.hpp",
     "include/mstar/kv/core/layout.hpp:2:", "public headers include only public headers"),
    ("src/manager/manager.cpp", "manager/gone.hpp",
     "src/manager/manager.cpp:2:", "resolves to no file of the tree"),
    ("src/manager/manager.cpp", "core/layout_test.cpp", "only tests itself includes tests"),
]


def run_checker(root):
    p = subprocess.run([sys.executable, CHECKER, "--root", root], capture_output=True, text=True)
    return p.returncode, p.stdout + p.stderr


class SyntheticTree(unittest.TestCase):
    def check(self, changes):
        with tempfile.TemporaryDirectory() as root:
            files = dict(CLEAN)
            files.update(changes)
            for path, text in files.items():
                os.makedirs(os.path.join(root, os.path.dirname(path)), exist_ok=True)
                with open(os.path.join(root, path), "w") as f:
                    f.write("// synthetic\n" + text)
            return run_checker(root)

    def assert_breaks(self, changes, *expected):
        rc, out = self.check(changes)
        self.assertEqual(rc, 1, out)
        self.assertIn("layer check: 1 include(s)", out)  # this break, no other
        for text in expected:
            self.assertIn(text, out)

    def test_clean_tree_passes(self):
        rc, out = self.check({})
        self.assertEqual(rc, 0, out)

    def test_each_broken_direction_fails_naming_it(self):
        for path, include, *expected in BREAKS:
            with self.subTest(path=path, include=include):
                self.assert_breaks({path: f'#include "{include}"\n'}, *expected)


    def test_cli_including_the_test_kit_fails(self):
        self.assert_breaks({"tools/mstar-kv/main.cpp": '#include "testkit/ports.hpp"\n'},
                           "tools/mstar-kv/main.cpp:2:",
                           "the installed CLI and its kit include no test kit")

    def test_library_including_the_tool_kit_fails(self):
        self.assert_breaks({"src/manager/manager.cpp": '#include "toolkit/child.hpp"\n'},
                           "src/manager/manager.cpp:2:", "library code includes no tool kit")

    def test_tests_including_the_cli_fail(self):
        self.assert_breaks({"tests/core/layout_test.cpp": '#include "main.hpp"\n'},
                           "tests/core/layout_test.cpp:2:",
                           "nothing but the development benchmarks includes the CLI's files")


class RealTree(unittest.TestCase):
    def test_this_tree_keeps_its_layers(self):
        rc, out = run_checker(SOURCE_DIR)
        self.assertEqual(rc, 0, out)


if __name__ == "__main__":
    if len(sys.argv) > 1 and not sys.argv[1].startswith("-"):
        SOURCE_DIR = os.path.abspath(sys.argv.pop(1))
    unittest.main()
