from configs.schemas import (
    AdmissionConfig,
    AppArgs,
    CacheConfig,
    EngineConfig,
    IngressConfig,
    ModelSource,
    ModelStageConfig,
    RouterConfig,
)

__all__ = [
    "AdmissionConfig",
    "AppArgs",
    "CacheConfig",
    "EngineConfig",
    "IngressConfig",
    "ModelSource",
    "ModelStageConfig",
    "RouterConfig",
]
