#!/usr/bin/env bash
# Copies Debian's OpenMPI 4.1 (mpirun, orted, libmpi, their MCA components, PMIx) into a folder
# that works from anywhere: OpenMPI and PMIx find their components and help files relative to
# OPAL_PREFIX / PMIX_INSTALL_PREFIX, so the tree mirrors /usr under that folder. For the GPU
# machine, whose image has no MPI: several ranks on the one H200 through comm_mpi's staging
# (scripts/device_gpu.sh mpi).
#   scripts/pack_openmpi.sh DEST      then, where it runs:  source DEST/env.sh
# Components whose libraries are not carried (UCX, libfabric, PSM, verbs, OpenSHMEM, netlink:
# the cluster fabrics) are left out; the ranks talk over shared memory (btl self,vader).
set -euo pipefail
dest=${1:?usage: pack_openmpi.sh DEST}
lib=/lib/x86_64-linux-gnu
ompi=/usr/lib/x86_64-linux-gnu/openmpi
pmix=/usr/lib/x86_64-linux-gnu/pmix2
[ -x /usr/bin/orterun ] || { echo "pack_openmpi.sh: no OpenMPI here (scripts/setup.sh installs openmpi-bin)" >&2; exit 1; }
rm -rf "$dest"
mkdir -p "$dest/bin" "$dest/lib" "$dest/lib/x86_64-linux-gnu/openmpi/lib" "$dest/lib/x86_64-linux-gnu/pmix2/lib" "$dest/share"
cp -L /usr/bin/orterun /usr/bin/orted "$dest/bin/"
ln -s orterun "$dest/bin/mpirun"
cp -a "$ompi/lib/openmpi3" "$dest/lib/x86_64-linux-gnu/openmpi/lib/"
cp -a "$pmix/lib/pmix" "$dest/lib/x86_64-linux-gnu/pmix2/lib/"
cp -a "$pmix/share" "$dest/lib/x86_64-linux-gnu/pmix2/"
cp -a /usr/share/openmpi "$dest/share/"
for l in libopen-rte.so.40 libopen-pal.so.40 libmpi.so.40 libhwloc.so.15 libevent-2.1.so.7 libevent_core-2.1.so.7 \
         libevent_pthreads-2.1.so.7 libmunge.so.2 libnuma.so.1 libudev.so.1 libz.so.1 libmca_common_sm.so.40 \
         libmca_common_monitoring.so.50 libmca_common_ompio.so.41; do
  cp -L "$lib/$l" "$dest/lib/"
done
cp -L "$pmix/lib/libpmix.so.2" "$dest/lib/"
# Drop the components that need a library not carried (a fabric's), so none fails to load.
for f in "$dest"/lib/x86_64-linux-gnu/openmpi/lib/openmpi3/*.so "$dest"/lib/x86_64-linux-gnu/pmix2/lib/pmix/*.so; do
  for d in $(ldd "$f" | awk '/=>/ {print $1}'); do
    case $d in libc.so.6|libm.so.6|libdl.so.2|libpthread.so.0|librt.so.1) ;;
      *) [ -e "$dest/lib/$d" ] || { rm -f "$f"; break; } ;;
    esac
  done
done
cat > "$dest/env.sh" <<'EOF'
# source this: OpenMPI from this folder, for the containers the tests run in.
_d=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export OPAL_PREFIX=$_d PMIX_INSTALL_PREFIX=$_d/lib/x86_64-linux-gnu/pmix2
export PATH=$_d/bin:$PATH LD_LIBRARY_PATH=$_d/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export OMPI_MCA_btl_vader_single_copy_mechanism=none OMPI_MCA_btl=self,vader OMPI_MCA_pml=ob1
export OMPI_MCA_rmaps_base_oversubscribe=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_mca_base_component_show_load_errors=0
EOF
du -sh "$dest" | awk '{print "pack_openmpi.sh: " $1 " in " $2}'
