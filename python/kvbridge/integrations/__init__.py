"""Integrations of kvbridge into inference engines, one module per engine.

Each module imports its engine when it is imported, never before: ``import kvbridge`` and
``import kvbridge.integrations`` stay free of engine dependencies.
"""
