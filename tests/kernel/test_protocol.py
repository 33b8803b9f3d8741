"""The forkd kernel speaks Jupyter's protocol like any Python kernel (jupyter_kernel_test)."""

from __future__ import annotations

import jupyter_kernel_test

from .conftest import ServerForKernels


class TestForkdKernelProtocol(jupyter_kernel_test.KernelTests):
    kernel_name = "forkd-python"
    language_name = "python"
    file_extension = ".py"
    code_hello_world = "print('hello, world')"
    code_stderr = "import sys; print('error', file=sys.stderr)"
    completion_samples = [{"text": "zi", "matches": {"zip"}}]
    complete_code_samples = ["1", "print('hello, world')", "def f(x):\n  return x*2\n\n\n"]
    incomplete_code_samples = ["print('''hello", "def f(x):\n  x*2"]
    invalid_code_samples = ["import = 7q"]
    code_page_something = "zip?"
    code_generate_error = "raise ValueError('bad')"
    code_execute_result = [{"code": "1+2+3", "result": "6"}, {"code": "[n * n for n in range(1, 4)]", "result": "[1, 4, 9]"}]
    code_display_data = [{"code": "from IPython.display import HTML, display; display(HTML('<b>test</b>'))",
                          "mime": "text/html"},
                         {"code": "from IPython.display import Math, display; display(Math('\\\\frac{1}{2}'))",
                          "mime": "text/latex"}]
    code_history_pattern = "1?2*"
    supported_history_operations = ("tail", "range", "search")
    code_inspect_sample = "zip"
    code_clear_output = "from IPython.display import clear_output; clear_output()"

    @classmethod
    def setUpClass(cls) -> None:
        cls.forkd_server = ServerForKernels()  # the kernel reads FORKD_URL/FORKD_TOKEN when it starts
        try:
            super().setUpClass()
        except BaseException:
            cls.forkd_server.stop()
            raise

    @classmethod
    def tearDownClass(cls) -> None:
        try:
            super().tearDownClass()
        finally:
            cls.forkd_server.stop()
