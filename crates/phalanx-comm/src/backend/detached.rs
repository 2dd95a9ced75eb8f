//! The detached backend: a group that knows its rank and size and has no
//! peers ([`crate::ProcessGroup::detached`]). It lets code that only asks
//! a group where it stands (a tensor-parallel block declaring rank r of
//! n's parameters, as a planner lays out a model) run without starting n
//! processes. Every operation that would move data fails, naming it.

use super::{Backend, Bytes, BytesMut, Call};
use crate::dtype::ReduceOp;
use crate::error::{CommError, Result};
use crate::transport::{Link, Msg};
use std::sync::Arc;

/// Carries nothing (see the module docs).
pub struct Detached;

fn refuse<T>(c: &Call) -> Result<T> {
    Err(CommError::Invalid(format!(
        "{}: rank {} of a detached group of {} has no peers to communicate with \
         (it only says where a rank stands)",
        c.op,
        c.me,
        c.n()
    )))
}

impl Backend for Detached {
    fn name(&self) -> &'static str {
        "detached"
    }

    fn all_reduce(&self, c: &Call, _buf: BytesMut, _op: ReduceOp) -> Result<()> {
        refuse(c)
    }

    fn reduce_scatter_v(
        &self,
        c: &Call,
        _input: Bytes,
        _counts: &[usize],
        _output: BytesMut,
        _op: ReduceOp,
    ) -> Result<()> {
        refuse(c)
    }

    fn all_gather_v(
        &self,
        c: &Call,
        _input: Bytes,
        _counts: &[usize],
        _output: BytesMut,
    ) -> Result<()> {
        refuse(c)
    }

    fn broadcast(&self, c: &Call, _buf: BytesMut, _root: usize) -> Result<()> {
        refuse(c)
    }

    fn reduce(&self, c: &Call, _buf: BytesMut, _root: usize, _op: ReduceOp) -> Result<()> {
        refuse(c)
    }

    fn all_to_all_v(
        &self,
        c: &Call,
        _input: Bytes,
        _send: &[usize],
        _output: BytesMut,
        _recv: &[usize],
    ) -> Result<()> {
        refuse(c)
    }

    fn exchange_signatures(&self, c: &Call, _mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        refuse(c)
    }

    fn send(&self, c: &Call, _dst: usize, _tag: u64, _data: &[u8]) -> Result<()> {
        refuse(c)
    }

    fn recv_into(&self, c: &Call, _src: usize, _tag: u64, _buf: &mut [u8]) -> Result<()> {
        refuse(c)
    }

    fn recv_message(&self, c: &Call, _src: usize, _tag: u64) -> Result<Msg> {
        refuse(c)
    }

    fn child(
        &self,
        c: &Call,
        _color: Option<u32>,
        _key: i64,
        _want: usize,
    ) -> Result<Option<Arc<dyn Backend>>> {
        refuse(c)
    }

    fn bytes_sent(&self) -> u64 {
        0
    }

    fn in_place_all_reduces(&self) -> u64 {
        0
    }

    fn link(&self, _me: usize, _global: usize) -> Option<Link> {
        None
    }

    fn failure(&self) -> Option<CommError> {
        None
    }

    fn shutdown(&self) {}

    fn abort(&self, _reason: &str) {}

    fn crash_for_test(&self) {}
}
