#!/usr/bin/python3
"""libloom from Python through ctypes (standard library only): open, find, step_f32,
export/import state, a bad manifest's FILE:LINE:COL, close.

Usage: ctypes_test.py LIBLOOM_PATH PLUGIN_DIR
"""
import ctypes
import os
import re
import struct
import sys
import tempfile
import unittest

LIB_PATH = os.environ.get("LOOM_LIBRARY", "")
PLUGIN_DIR = os.environ.get("LOOM_TEST_PLUGIN_DIR", "")


class OpenOptions(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("validate_only", ctypes.c_int32),
        ("plugin_path", ctypes.c_char_p),
        ("bootstrap", ctypes.c_void_p),
        ("log_level", ctypes.c_int32),
        ("reserved", ctypes.c_int32),
    ]


LOOM_OK = 0
LOOM_ERR_INVALID_ARGUMENT = 1
LOOM_ERR_NOT_FOUND = 2
LOOM_ERR_DATA_LOSS = 9
LOOM_LOG_ERROR = 4


def load():
    lib = ctypes.CDLL(LIB_PATH)
    lib.loom_version.restype = ctypes.c_char_p
    lib.loom_last_error.restype = ctypes.c_char_p
    lib.loom_last_error_code.restype = ctypes.c_int32
    lib.loom_open_file.argtypes = [ctypes.c_char_p, ctypes.POINTER(OpenOptions),
                                   ctypes.POINTER(ctypes.c_void_p)]
    lib.loom_open_string.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.POINTER(OpenOptions),
                                     ctypes.POINTER(ctypes.c_void_p)]
    lib.loom_close.argtypes = [ctypes.c_void_p]
    lib.loom_close.restype = None
    lib.loom_instance_count.argtypes = [ctypes.c_void_p]
    lib.loom_instance_count.restype = ctypes.c_size_t
    lib.loom_find_instance.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p,
                                       ctypes.POINTER(ctypes.c_void_p)]
    lib.loom_instance_name.argtypes = [ctypes.c_void_p]
    lib.loom_instance_name.restype = ctypes.c_char_p
    lib.loom_optimizer_step_f32.argtypes = [
        ctypes.c_void_p, ctypes.POINTER(ctypes.POINTER(ctypes.c_float)),
        ctypes.POINTER(ctypes.POINTER(ctypes.c_float)), ctypes.POINTER(ctypes.c_int64),
        ctypes.c_size_t, ctypes.c_double]
    lib.loom_instance_export_state.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                               ctypes.POINTER(ctypes.c_size_t)]
    lib.loom_instance_import_state.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    return lib


class CtypesTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.lib = load()
        cls.tmp = tempfile.TemporaryDirectory(prefix="loom-ctypes-")

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def options(self):
        o = OpenOptions()
        o.struct_size = OpenOptions.reserved.offset + 4
        o.validate_only = 0
        o.plugin_path = PLUGIN_DIR.encode()
        o.bootstrap = None
        o.log_level = LOOM_LOG_ERROR
        return o

    def open(self, text, name="m.toml"):
        path = os.path.join(self.tmp.name, name)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        session = ctypes.c_void_p()
        opts = self.options()
        rc = self.lib.loom_open_file(path.encode(), ctypes.byref(opts), ctypes.byref(session))
        return rc, session, path

    def find(self, session, kind, name):
        inst = ctypes.c_void_p()
        rc = self.lib.loom_find_instance(session, kind.encode(), name.encode(), ctypes.byref(inst))
        return rc, inst

    def test_version(self):
        self.assertRegex(self.lib.loom_version().decode(), r"^\d+\.\d+\.\d+")

    def test_open_step_state_close(self):
        rc, session, _ = self.open('[optimizer.main]\nplugin = "probe"\ntag = "py"\n'
                                   'weight_decay = 0.5\nstart_step = 2\n')
        self.assertEqual(rc, LOOM_OK, self.lib.loom_last_error().decode())
        try:
            self.assertEqual(self.lib.loom_instance_count(session), 1)
            rc, opt = self.find(session, "optimizer", "main")
            self.assertEqual(rc, LOOM_OK)
            self.assertEqual(self.lib.loom_instance_name(opt), b"main")

            p = (ctypes.c_float * 3)(1.0, 2.0, -4.0)
            g = (ctypes.c_float * 3)(0.5, -0.5, 1.0)
            params = (ctypes.POINTER(ctypes.c_float) * 1)(ctypes.cast(p, ctypes.POINTER(ctypes.c_float)))
            grads = (ctypes.POINTER(ctypes.c_float) * 1)(ctypes.cast(g, ctypes.POINTER(ctypes.c_float)))
            numels = (ctypes.c_int64 * 1)(3)
            expected = [1.0, 2.0, -4.0]
            for _ in range(2):
                rc = self.lib.loom_optimizer_step_f32(opt, params, grads, numels, 1, 0.1)
                self.assertEqual(rc, LOOM_OK, self.lib.loom_last_error().decode())
                expected = [struct.unpack("f", struct.pack("f", pv - 0.1 * (gv + 0.5 * pv)))[0]
                            for pv, gv in zip(expected, [0.5, -0.5, 1.0])]
            for got, want in zip(list(p), expected):
                self.assertAlmostEqual(got, want, places=6)

            size = ctypes.c_size_t()
            self.assertEqual(self.lib.loom_instance_export_state(opt, None, 0, ctypes.byref(size)), LOOM_OK)
            self.assertEqual(size.value, 24)
            buf = ctypes.create_string_buffer(size.value)
            self.assertEqual(self.lib.loom_instance_export_state(opt, buf, size.value, ctypes.byref(size)),
                             LOOM_OK)
            magic, version, _, steps = struct.unpack("<8sIIq", buf.raw)
            self.assertEqual((magic, version, steps), (b"PROBEST1", 1, 4))

            # Foreign bytes are refused; the exported blob is accepted.
            junk = ctypes.create_string_buffer(b"x" * 24, 24)
            self.assertEqual(self.lib.loom_instance_import_state(opt, junk, 24), LOOM_ERR_DATA_LOSS)
            self.assertIn(b"bad magic", self.lib.loom_last_error())
            steps_back = struct.pack("<8sIIq", b"PROBEST1", 1, 0, 40)
            back = ctypes.create_string_buffer(steps_back, 24)
            self.assertEqual(self.lib.loom_instance_import_state(opt, back, 24), LOOM_OK)
            self.assertEqual(self.lib.loom_instance_export_state(opt, buf, 24, ctypes.byref(size)), LOOM_OK)
            self.assertEqual(struct.unpack("<8sIIq", buf.raw)[3], 40)

            rc, _ = self.find(session, "optimizer", "absent")
            self.assertEqual(rc, LOOM_ERR_NOT_FOUND)
            self.assertIn(b"'absent'", self.lib.loom_last_error())
        finally:
            self.lib.loom_close(session)

    def test_bad_manifest_names_file_line_col(self):
        rc, session, path = self.open('[optimizer.main]\nplugin = "probe"\ntag = "t"\nweight_decay = -1\n',
                                      name="bad.toml")
        self.assertEqual(rc, LOOM_ERR_INVALID_ARGUMENT)
        self.assertFalse(session.value)
        err = self.lib.loom_last_error().decode()
        self.assertEqual(self.lib.loom_last_error_code(), LOOM_ERR_INVALID_ARGUMENT)
        self.assertTrue(re.match(re.escape(path) + r":4:16: parameter 'weight_decay' of optimizer.main "
                                 r"= -1 is out of range \[0, 1\]$", err), err)

    def test_open_string(self):
        session = ctypes.c_void_p()
        opts = self.options()
        rc = self.lib.loom_open_string(b'[comm.w]\nplugin = "probe"\npeer = "w"\n', b"inline.toml",
                                       ctypes.byref(opts), ctypes.byref(session))
        self.assertEqual(rc, LOOM_ERR_INVALID_ARGUMENT)
        self.assertEqual(self.lib.loom_last_error().decode(),
                         "inline.toml:3:8: reference cycle: comm.w -> comm.w")


if __name__ == "__main__":
    if len(sys.argv) >= 3:
        LIB_PATH, PLUGIN_DIR = sys.argv[1], sys.argv[2]
        del sys.argv[1:3]
    if not LIB_PATH or not PLUGIN_DIR:
        sys.exit("usage: ctypes_test.py LIBLOOM_PATH PLUGIN_DIR")
    unittest.main(verbosity=2)
