"""Simulators behind one small interface (LIBERO, MetaWorld) and the env worker processes that host them."""

from wamkit.envs.base import Env, EnvSpec, TaskInfo, make_env, register_env, env_names  # noqa: F401
