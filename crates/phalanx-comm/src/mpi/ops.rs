//! `ProcessGroup` operations on MPI: each is one non-blocking MPI call,
//! waited on with the group's deadline.
//!
//! - f32, f64, i32 and i64 reduce with MPI's own operations; f16 and bf16
//!   with user operations that add in the element type, as the native
//!   backend does. `Avg` is a sum divided by the group size afterwards.
//! - MPI tags are 31-bit; Phalanx's are 64-bit. A message carries its full
//!   tag in an 8-byte header and travels under the tag folded to 31 bits;
//!   the receiver checks the header, so a fold collision is an error, never
//!   a wrong message.
//! - Sends are buffered (`send` returns once MPI owns a copy), as on the
//!   native transport, so two ranks may send to each other before either
//!   receives.
//! - `bytes_sent` counts what the native ring algorithms would move, so
//!   `comm_bytes` in logs means the same on both backends.

use super::{check, check_lazy, displs, finalized, ints, Comm, InFlight, Pacer};
use crate::dtype::{DType, Element, ReduceOp};
use crate::error::{invalid, CommError, Result};
use half::{bf16, f16};
use mpi::ffi;
use std::ffi::{c_int, c_void};
use std::sync::atomic::Ordering;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The MPI datatype that carries `T` (its bits, for the half types).
fn datatype<T: Element>() -> ffi::MPI_Datatype {
    // SAFETY: reading extern constants of an initialised MPI.
    unsafe {
        match T::DTYPE {
            DType::F32 => ffi::RSMPI_FLOAT,
            DType::F64 => ffi::RSMPI_DOUBLE,
            DType::I32 => ffi::RSMPI_INT32_T,
            DType::I64 => ffi::RSMPI_INT64_T,
            DType::F16 | DType::BF16 => ffi::RSMPI_UINT16_T,
        }
    }
}

/// A user reduction: `inout[i] = inout[i] (op) in[i]` in the element type.
unsafe fn user_reduce<T: Element>(
    invec: *mut c_void,
    inoutvec: *mut c_void,
    len: *mut c_int,
    _dt: *mut ffi::MPI_Datatype,
    op: ReduceOp,
) {
    let n = *len as usize;
    let a = std::slice::from_raw_parts_mut(inoutvec as *mut T, n);
    let b = std::slice::from_raw_parts(invec as *const T, n);
    T::reduce_into(op, a, b);
}

macro_rules! user_op {
    ($name:ident, $t:ty, $op:expr) => {
        unsafe extern "C" fn $name(
            a: *mut c_void,
            b: *mut c_void,
            n: *mut c_int,
            d: *mut ffi::MPI_Datatype,
        ) {
            user_reduce::<$t>(a, b, n, d, $op)
        }
    };
}
user_op!(f16_sum, f16, ReduceOp::Sum);
user_op!(f16_max, f16, ReduceOp::Max);
user_op!(f16_min, f16, ReduceOp::Min);
user_op!(bf16_sum, bf16, ReduceOp::Sum);
user_op!(bf16_max, bf16, ReduceOp::Max);
user_op!(bf16_min, bf16, ReduceOp::Min);

/// An `MPI_Op` handle, created once per process.
struct Op(ffi::MPI_Op);
// SAFETY: operation handles are immutable once created.
unsafe impl Send for Op {}
unsafe impl Sync for Op {}

type UserFn = unsafe extern "C" fn(*mut c_void, *mut c_void, *mut c_int, *mut ffi::MPI_Datatype);

fn user(cell: &'static OnceLock<Op>, f: UserFn) -> ffi::MPI_Op {
    cell.get_or_init(|| {
        // SAFETY: a null handle, filled by MPI_Op_create.
        let mut op: ffi::MPI_Op = unsafe { std::mem::zeroed() };
        // SAFETY: `f` matches MPI_User_function; 1 = commutative.
        unsafe { ffi::MPI_Op_create(Some(f), 1, &mut op) };
        Op(op)
    })
    .0
}

/// The MPI operation for `op` on `T` (`Avg` reduces as `Sum`).
fn mpi_op<T: Element>(op: ReduceOp) -> ffi::MPI_Op {
    static OPS: [OnceLock<Op>; 6] = [const { OnceLock::new() }; 6];
    let (sum, max, min): (UserFn, UserFn, UserFn) = match T::DTYPE {
        DType::F16 => (f16_sum, f16_max, f16_min),
        DType::BF16 => (bf16_sum, bf16_max, bf16_min),
        // SAFETY: reading extern constants.
        _ => unsafe {
            return match op {
                ReduceOp::Sum | ReduceOp::Avg => ffi::RSMPI_SUM,
                ReduceOp::Max => ffi::RSMPI_MAX,
                ReduceOp::Min => ffi::RSMPI_MIN,
            };
        },
    };
    let base = if T::DTYPE == DType::F16 { 0 } else { 3 };
    match op {
        ReduceOp::Sum | ReduceOp::Avg => user(&OPS[base], sum),
        ReduceOp::Max => user(&OPS[base + 1], max),
        ReduceOp::Min => user(&OPS[base + 2], min),
    }
}

/// `MPI_IN_PLACE`, which the bindings do not export: its value is fixed
/// by each implementation family (Open MPI's `mpi.h`: `(void *) 1`;
/// MPICH and its derivatives: `(void *) -1`). `None` for another library:
/// then the send buffer is a copy.
fn in_place() -> Option<*const c_void> {
    static V: OnceLock<Option<usize>> = OnceLock::new();
    let v = V.get_or_init(|| {
        let lib = super::library_version();
        if lib.contains("Open MPI") {
            Some(1)
        } else if ["MPICH", "Intel(R) MPI", "MVAPICH", "CRAY MPICH"]
            .iter()
            .any(|m| lib.contains(m))
        {
            Some(usize::MAX)
        } else {
            None
        }
    });
    v.map(|v| v as *const c_void)
}

fn null_request() -> ffi::MPI_Request {
    // SAFETY: reading an extern constant.
    unsafe { ffi::RSMPI_REQUEST_NULL }
}

fn count(n: usize, what: &str) -> Result<c_int> {
    Ok(ints(&[n], what)?[0])
}

/// Fold a 64-bit tag into MPI's guaranteed 31 bits (XOR of 31-bit slices).
fn fold_tag(tag: u64) -> c_int {
    let m = (1u64 << 31) - 1;
    ((tag & m) ^ ((tag >> 31) & m) ^ (tag >> 62)) as c_int
}

impl Comm {
    fn count_bytes(&self, b: usize) {
        self.bytes.fetch_add(b as u64, Ordering::Relaxed);
    }

    /// Ring traffic of an all-reduce of `bytes`: 2 (n-1)/n of it.
    fn ring_share(&self, bytes: usize, factor: usize) -> usize {
        factor * bytes * (self.size - 1) / self.size.max(1)
    }

    /// Start `start` (which fills the request) and wait for it.
    fn run_nb(
        &self,
        what: &dyn Fn() -> String,
        start: impl FnOnce(*mut ffi::MPI_Request) -> c_int,
    ) -> Result<super::Status> {
        finalized()?;
        self.reap_sends()?;
        let mut req = null_request();
        check(start(&mut req), &what())?;
        self.wait(&mut req, what)
    }

    /// One collective: on a communication thread (overlapping computation)
    /// the non-blocking form `start`, polled; on the caller's own thread the
    /// blocking form `block`, MPI's fastest path.
    fn run(
        &self,
        what: &dyn Fn() -> String,
        start: impl FnOnce(*mut ffi::MPI_Request) -> c_int,
        block: impl FnOnce() -> c_int,
    ) -> Result<()> {
        if crate::work::on_comm_thread() {
            return self.run_nb(what, start).map(|_| ());
        }
        finalized()?;
        self.reap_sends()?;
        self.blocking(what, block)
    }

    pub fn all_reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        if self.size == 1 || buf.is_empty() {
            return Ok(());
        }
        let n = count(buf.len(), "all_reduce")?;
        // In place where the library's MPI_IN_PLACE is known, else a copy.
        let copy = if in_place().is_some() {
            Vec::new()
        } else {
            buf.to_vec()
        };
        let sp = in_place().unwrap_or(copy.as_ptr().cast());
        self.count_bytes(self.ring_share(std::mem::size_of_val(buf), 2));
        let rp = buf.as_mut_ptr().cast();
        let (dt, mop, comm) = (datatype::<T>(), mpi_op::<T>(op), self.coll.0);
        self.run(
            &|| format!("all_reduce({}, count={n})", T::DTYPE.name()),
            |r| unsafe { ffi::MPI_Iallreduce(sp, rp, n, dt, mop, comm, r) },
            || unsafe { ffi::MPI_Allreduce(sp, rp, n, dt, mop, comm) },
        )?;
        if op == ReduceOp::Avg {
            T::div_by(buf, self.size);
        }
        Ok(())
    }

    pub fn reduce_scatter_v<T: Element>(
        &self,
        input: &[T],
        counts: &[usize],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        if self.size == 1 {
            output.copy_from_slice(input);
            return Ok(());
        }
        let c = ints(counts, "reduce_scatter")?;
        self.count_bytes(self.ring_share(std::mem::size_of_val(input), 1));
        let (sp, rp, cp) = (
            input.as_ptr().cast(),
            output.as_mut_ptr().cast(),
            c.as_ptr(),
        );
        let (dt, mop, comm) = (datatype::<T>(), mpi_op::<T>(op), self.coll.0);
        self.run(
            &|| format!("reduce_scatter({})", T::DTYPE.name()),
            |r| unsafe { ffi::MPI_Ireduce_scatter(sp, rp, cp, dt, mop, comm, r) },
            || unsafe { ffi::MPI_Reduce_scatter(sp, rp, cp, dt, mop, comm) },
        )?;
        if op == ReduceOp::Avg {
            T::div_by(output, self.size);
        }
        Ok(())
    }

    pub fn all_gather_v<T: Element>(
        &self,
        input: &[T],
        counts: &[usize],
        output: &mut [T],
    ) -> Result<()> {
        if self.size == 1 {
            output.copy_from_slice(input);
            return Ok(());
        }
        let (c, d) = (ints(counts, "all_gather")?, displs(counts, "all_gather")?);
        let mine = count(input.len(), "all_gather")?;
        self.count_bytes(self.ring_share(std::mem::size_of_val(output), 1));
        let (sp, rp) = (input.as_ptr().cast(), output.as_mut_ptr().cast());
        let (cp, dp) = (c.as_ptr(), d.as_ptr());
        let (dt, comm) = (datatype::<T>(), self.coll.0);
        self.run(
            &|| format!("all_gather({})", T::DTYPE.name()),
            |r| unsafe { ffi::MPI_Iallgatherv(sp, mine, dt, rp, cp, dp, dt, comm, r) },
            || unsafe { ffi::MPI_Allgatherv(sp, mine, dt, rp, cp, dp, dt, comm) },
        )
    }

    pub fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        if self.size == 1 || buf.is_empty() {
            return Ok(());
        }
        let n = count(buf.len(), "broadcast")?;
        if self.rank == root {
            self.count_bytes(std::mem::size_of_val(buf));
        }
        let (p, dt, comm) = (buf.as_mut_ptr().cast(), datatype::<T>(), self.coll.0);
        let ro = root as c_int;
        self.run(
            &|| format!("broadcast(root={root})"),
            |r| unsafe { ffi::MPI_Ibcast(p, n, dt, ro, comm, r) },
            || unsafe { ffi::MPI_Bcast(p, n, dt, ro, comm) },
        )
    }

    pub fn reduce<T: Element>(&self, buf: &mut [T], root: usize, op: ReduceOp) -> Result<()> {
        if self.size == 1 || buf.is_empty() {
            return Ok(());
        }
        let n = count(buf.len(), "reduce")?;
        // Only the root's buffer is written (in place where the library's
        // MPI_IN_PLACE is known, else from a copy); others only send.
        let root_copy = match (self.rank == root, in_place()) {
            (true, None) => buf.to_vec(),
            _ => Vec::new(),
        };
        let (sp, recv): (*const c_void, *mut c_void) = if self.rank == root {
            let sp = in_place().unwrap_or(root_copy.as_ptr().cast());
            (sp, buf.as_mut_ptr().cast())
        } else {
            (buf.as_ptr().cast(), std::ptr::null_mut())
        };
        self.count_bytes(std::mem::size_of_val(buf));
        let (dt, mop, comm) = (datatype::<T>(), mpi_op::<T>(op), self.coll.0);
        let ro = root as c_int;
        self.run(
            &|| format!("reduce(root={root})"),
            |r| unsafe { ffi::MPI_Ireduce(sp, recv, n, dt, mop, ro, comm, r) },
            || unsafe { ffi::MPI_Reduce(sp, recv, n, dt, mop, ro, comm) },
        )?;
        if self.rank == root && op == ReduceOp::Avg {
            T::div_by(buf, self.size);
        }
        Ok(())
    }

    pub fn all_to_all_v<T: Element>(
        &self,
        input: &[T],
        send: &[usize],
        output: &mut [T],
        recv: &[usize],
    ) -> Result<()> {
        let (sc, sd) = (ints(send, "all_to_all")?, displs(send, "all_to_all")?);
        let (rc, rd) = (ints(recv, "all_to_all")?, displs(recv, "all_to_all")?);
        let out_bytes: usize = send
            .iter()
            .enumerate()
            .filter(|(j, _)| *j != self.rank)
            .map(|(_, &c)| c * std::mem::size_of::<T>())
            .sum();
        self.count_bytes(out_bytes);
        let (sp, rp) = (input.as_ptr().cast(), output.as_mut_ptr().cast());
        let (scp, sdp, rcp, rdp) = (sc.as_ptr(), sd.as_ptr(), rc.as_ptr(), rd.as_ptr());
        let (dt, comm) = (datatype::<T>(), self.coll.0);
        self.run(
            &|| format!("all_to_all({})", T::DTYPE.name()),
            |r| unsafe { ffi::MPI_Ialltoallv(sp, scp, sdp, dt, rp, rcp, rdp, dt, comm, r) },
            || unsafe { ffi::MPI_Alltoallv(sp, scp, sdp, dt, rp, rcp, rdp, dt, comm) },
        )
    }

    pub fn barrier(&self) -> Result<()> {
        let comm = self.coll.0;
        self.run(
            &|| "barrier".into(),
            |r| unsafe { ffi::MPI_Ibarrier(comm, r) },
            || unsafe { ffi::MPI_Barrier(comm) },
        )
    }

    /// Buffered send: returns once MPI holds a copy with the tag header
    /// (any length; a typed `send` sends its bytes).
    pub fn send_bytes(&self, bytes: &[u8], dst: usize, tag: u64) -> Result<()> {
        finalized()?;
        self.reap_sends()?;
        let mut msg = Vec::with_capacity(8 + bytes.len());
        msg.extend_from_slice(&tag.to_le_bytes());
        msg.extend_from_slice(bytes);
        let n = count(msg.len(), "send")?;
        let mut req = null_request();
        let rc = unsafe {
            ffi::MPI_Isend(
                msg.as_ptr().cast(),
                n,
                ffi::RSMPI_UINT8_T,
                dst as c_int,
                fold_tag(tag),
                self.p2p.0,
                &mut req,
            )
        };
        check(rc, &format!("send(to rank {dst}, tag={tag})"))?;
        self.count_bytes(bytes.len());
        self.sends.lock().unwrap().push(InFlight { req, _buf: msg });
        Ok(())
    }

    /// Receive exactly `buf.len()` bytes sent under `tag` by `src`.
    pub fn recv(&self, buf: &mut [u8], src: usize, tag: u64) -> Result<()> {
        let want = buf.len();
        // One byte more than expected, so a longer message is seen as one.
        let mut msg = vec![0u8; 8 + want + 1];
        let n = count(msg.len(), "recv")?;
        let what = || format!("recv(from rank {src}, tag={tag})");
        let st = self.run_nb(&what, |r| unsafe {
            ffi::MPI_Irecv(
                msg.as_mut_ptr().cast(),
                n,
                ffi::RSMPI_UINT8_T,
                src as c_int,
                fold_tag(tag),
                self.p2p.0,
                r,
            )
        });
        let st = match st {
            Ok(s) => s,
            Err(CommError::Io(m)) if m.contains("truncat") => {
                return Err(invalid!(
                    "{}: the message is longer than {want} bytes",
                    what()
                ))
            }
            Err(e) => return Err(e),
        };
        let mut got: c_int = 0;
        check(
            unsafe { ffi::MPI_Get_count(&st.0, ffi::RSMPI_UINT8_T, &mut got) },
            "MPI_Get_count",
        )?;
        let got = got.max(0) as usize;
        if got < 8 || u64::from_le_bytes(msg[..8].try_into().unwrap()) != tag {
            return Err(CommError::Protocol(format!(
                "{}: a message under another tag folded to the same MPI tag {} arrived first",
                what(),
                fold_tag(tag)
            )));
        }
        if got - 8 != want {
            return Err(invalid!(
                "recv from rank {src} tag {tag}: expected {want} bytes, got {}",
                got - 8
            ));
        }
        buf.copy_from_slice(&msg[8..8 + want]);
        Ok(())
    }

    /// Receive the next message from `src` under `tag`, of whatever length
    /// it has (`recv_bytes`), into 8-byte words. Probes until `deadline`;
    /// nothing is posted before the message is there, so a timeout is a
    /// plain error and leaves nothing behind.
    pub fn recv_message(
        &self,
        src: usize,
        tag: u64,
        deadline: Instant,
    ) -> Result<(Vec<u64>, usize)> {
        finalized()?;
        self.reap_sends()?;
        let what = || format!("recv_bytes(from rank {src}, tag={tag})");
        // An idle receiver (an RPC reader thread) sleeps up to 1 ms.
        let mut pace = Pacer::new(Duration::from_millis(1));
        loop {
            let mut flag: c_int = 0;
            // SAFETY: zeroed handles and status are valid out-parameters.
            let mut msg: ffi::MPI_Message = unsafe { std::mem::zeroed() };
            let mut st: ffi::MPI_Status = unsafe { std::mem::zeroed() };
            let rc = unsafe {
                ffi::MPI_Improbe(
                    src as c_int,
                    fold_tag(tag),
                    self.p2p.0,
                    &mut flag,
                    &mut msg,
                    &mut st,
                )
            };
            check_lazy(rc, &what)?;
            if flag != 0 {
                let mut got: c_int = 0;
                check(
                    unsafe { ffi::MPI_Get_count(&st, ffi::RSMPI_UINT8_T, &mut got) },
                    "MPI_Get_count",
                )?;
                let got = got.max(0) as usize;
                let mut words = vec![0u64; got.div_ceil(8).max(1)];
                let rc = unsafe {
                    ffi::MPI_Mrecv(
                        words.as_mut_ptr().cast(),
                        got as c_int,
                        ffi::RSMPI_UINT8_T,
                        &mut msg,
                        ffi::RSMPI_STATUS_IGNORE,
                    )
                };
                check(rc, &what())?;
                if got < 8 || u64::from_le(words[0]) != tag {
                    return Err(CommError::Protocol(format!(
                        "{}: a message under another tag folded to the same MPI tag {} arrived first",
                        what(),
                        fold_tag(tag)
                    )));
                }
                // Drop the tag header: the payload starts at the next word.
                words.remove(0);
                return Ok((words, got - 8));
            }
            if pace.pause() && Instant::now() > deadline {
                return Err(CommError::Timeout(format!("{} past its deadline", what())));
            }
        }
    }
}
