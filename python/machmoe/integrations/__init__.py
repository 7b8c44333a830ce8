"""Integrations of machmoe with other libraries, one submodule each, imported on request:

    import machmoe.integrations.transformers   # registers experts_implementation="machmoe"
    import machmoe.integrations.torchtitan     # MachMoEConverter for torchtitan's MoE

Importing this package imports none of them (each needs its library installed).
"""
