"""The previous release's module of the sphere models: now :mod:`meanfield.isotropic`.

Importing it warns; it will be removed in the next release.
"""

import warnings

from .isotropic import SPHERE_MODELS, SphereAttention  # noqa: F401

warnings.warn("meanfield.sphere is now meanfield.isotropic (IsotropicAttention); 'sphere' names the manifold "
              "(meanfield.geometry.Sphere)", DeprecationWarning, stacklevel=2)
