# Placeholder: all metadata lives in pyproject.toml. This file exists so that a later issue
# can add the CMake-driven build of the extension module here.
from setuptools import setup

setup()
