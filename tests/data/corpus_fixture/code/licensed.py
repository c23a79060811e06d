# Copyright (c) 2024 Example Corp. All rights reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.

import os
import sys
from typing import Any

__all__ = ["main"]


def main(argv: Any = None) -> int:
    """Run.

    Parameters
    ----------
    argv : list
    """
    return len(os.sep) + len(sys.argv)
