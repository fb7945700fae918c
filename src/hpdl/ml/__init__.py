"""Distributed classical ML with scikit-learn's API: one process, SPMD on hpdl ranks, or a Dask cluster.

from hpdl.ml import KMeans
KMeans(n_clusters=16).fit(X)                   # one process
KMeans(n_clusters=16, comm=comm).fit(X_local)  # every rank passes its shard, every rank gets the model
KMeans(n_clusters=16).fit(dask_array)          # on the current dask.distributed Client
"""

from hpdl.ml.base import ShardMismatchError
from hpdl.ml.decomposition import PCA, TruncatedSVD
from hpdl.ml.kmeans import KMeans
from hpdl.ml.linear import LinearRegression, Ridge
from hpdl.ml.logistic import LogisticRegression
from hpdl.ml.neighbors import KNeighborsClassifier, KNeighborsRegressor, NearestNeighbors

__all__ = [
    "KMeans",
    "LinearRegression",
    "Ridge",
    "LogisticRegression",
    "PCA",
    "TruncatedSVD",
    "NearestNeighbors",
    "KNeighborsClassifier",
    "KNeighborsRegressor",
    "ShardMismatchError",
]
