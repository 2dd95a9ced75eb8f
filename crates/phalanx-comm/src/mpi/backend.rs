//! The MPI communicator as a comm [`Backend`]: each operation is one MPI
//! call on the group's communicator pair (see the module docs).

use super::Comm;
use crate::backend::{Backend, Bytes, BytesMut, Call};
use crate::dtype::ReduceOp;
use crate::error::{invalid, CommError, Result};
use crate::for_dtype;
use crate::group::{signature_from_words, signature_words};
use crate::transport::{Link, Msg};
use std::sync::Arc;

impl Backend for Comm {
    fn name(&self) -> &'static str {
        "mpi"
    }

    fn all_reduce(&self, _c: &Call, buf: BytesMut, op: ReduceOp) -> Result<()> {
        for_dtype!(buf.dtype(), T => Comm::all_reduce(self, buf.typed::<T>(), op))
    }

    fn reduce_scatter_v(
        &self,
        _c: &Call,
        input: Bytes,
        counts: &[usize],
        output: BytesMut,
        op: ReduceOp,
    ) -> Result<()> {
        for_dtype!(input.dtype(), T => {
            Comm::reduce_scatter_v(self, input.typed::<T>(), counts, output.typed::<T>(), op)
        })
    }

    fn all_gather_v(
        &self,
        _c: &Call,
        input: Bytes,
        counts: &[usize],
        output: BytesMut,
    ) -> Result<()> {
        for_dtype!(input.dtype(), T => {
            Comm::all_gather_v(self, input.typed::<T>(), counts, output.typed::<T>())
        })
    }

    fn broadcast(&self, _c: &Call, buf: BytesMut, root: usize) -> Result<()> {
        for_dtype!(buf.dtype(), T => Comm::broadcast(self, buf.typed::<T>(), root))
    }

    fn reduce(&self, _c: &Call, buf: BytesMut, root: usize, op: ReduceOp) -> Result<()> {
        for_dtype!(buf.dtype(), T => Comm::reduce(self, buf.typed::<T>(), root, op))
    }

    fn all_to_all_v(
        &self,
        _c: &Call,
        input: Bytes,
        send: &[usize],
        output: BytesMut,
        recv: &[usize],
    ) -> Result<()> {
        for_dtype!(input.dtype(), T => {
            Comm::all_to_all_v(self, input.typed::<T>(), send, output.typed::<T>(), recv)
        })
    }

    /// One `MPI_Allgather` of the fixed-size signatures.
    fn exchange_signatures(&self, c: &Call, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        let w = signature_words(mine);
        let mut all = vec![0i64; w.len() * c.n()];
        let counts = vec![w.len(); c.n()];
        Comm::all_gather_v(self, &w, &counts, &mut all)?;
        Ok(all
            .chunks(w.len())
            .map(|x| signature_from_words(x, mine.len()))
            .collect())
    }

    fn send(&self, _c: &Call, dst: usize, tag: u64, data: &[u8]) -> Result<()> {
        self.send_bytes(data, dst, tag)
    }

    fn recv_into(&self, _c: &Call, src: usize, tag: u64, buf: &mut [u8]) -> Result<()> {
        self.recv(buf, src, tag)
    }

    fn recv_message(&self, c: &Call, src: usize, tag: u64) -> Result<Msg> {
        Comm::recv_message(self, src, tag, c.deadline).map(|(words, len)| Msg { words, len })
    }

    /// An `MPI_Comm_split`, checked to have `want` members (two requested
    /// groups whose colors collide would merge).
    fn child(
        &self,
        _c: &Call,
        color: Option<u32>,
        key: i64,
        want: usize,
    ) -> Result<Option<Arc<dyn Backend>>> {
        let Some(sub) = self.split(color, key)? else {
            return Ok(None);
        };
        if sub.size() != want {
            return Err(invalid!(
                "MPI_Comm_split gave a group of {} ranks where {want} were asked for \
                 (two groups' colors collided); create the groups in another order",
                sub.size()
            ));
        }
        Ok(Some(Arc::new(sub)))
    }

    fn bytes_sent(&self) -> u64 {
        Comm::bytes_sent(self)
    }

    fn in_place_all_reduces(&self) -> u64 {
        0
    }

    fn link(&self, me: usize, global: usize) -> Option<Link> {
        (global != me).then_some(Link::Mpi)
    }

    /// A broken MPI job ends through `MPI_Abort`: there is no failed state.
    fn failure(&self) -> Option<CommError> {
        None
    }

    fn shutdown(&self) {
        Comm::shutdown(self)
    }

    fn abort(&self, reason: &str) {
        Comm::abort(self, reason)
    }

    fn abort_ends_job(&self) -> bool {
        true
    }

    fn crash_for_test(&self) {
        std::process::abort()
    }
}
