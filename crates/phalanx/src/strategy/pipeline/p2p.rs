//! Point-to-point transfers of activations and gradients between stages.
//!
//! Tags identify (step, direction, micro-batch, chunk), so two messages of
//! one step can never be confused, whatever order they arrive in (the
//! transport queues messages per (peer, tag)):
//!
//! `tag = step[24 bits] << 40 | direction[2] << 38 | chunk[14] << 24 | mb[24]`
//!
//! where `chunk` is the *receiving* chunk. An activation's shape is only
//! known to its sender, so it travels as a small header (dtype, rank, dims)
//! followed by the data; a gradient's shape is the shape of the activation
//! the receiving stage produced, so it needs no header and its receive can be
//! posted before it is needed.
//!
//! Receives are posted ahead with `recv_async`, in the order the table
//! consumes them: the group's point-to-point thread serves them in that order
//! while this rank computes. Sends hand the data to the transport (its reader
//! thread on the peer buffers it), so they never wait for the peer.
//!
//! ```
//! use phalanx::strategy::pipeline::p2p::{tag, Dir};
//! assert_ne!(tag(1, Dir::Act, 3, 2), tag(1, Dir::Grad, 3, 2));
//! assert_ne!(tag(1, Dir::Act, 3, 2), tag(2, Dir::Act, 3, 2));
//! ```

use candle_core::{DType, Device, Shape, Tensor};
use phalanx_comm::{bf16, f16, ProcessGroup, Work};

use crate::error::{Error, Result};

/// What a message carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dir {
    /// An activation's header: dtype, rank, dims.
    ActHeader = 0,
    Act = 1,
    Grad = 2,
}

/// Largest micro-batch and chunk indices a tag can hold.
pub const MAX_MB: usize = 1 << 24;
pub const MAX_CHUNKS: usize = 1 << 14;
const HEADER: usize = 8;

/// The tag of a message (see the module docs).
pub fn tag(step: u64, dir: Dir, mb: usize, chunk: usize) -> u64 {
    debug_assert!(mb < MAX_MB && chunk < MAX_CHUNKS);
    ((step & 0xff_ffff) << 40)
        | ((dir as u64) << 38)
        | (((chunk as u64) & 0x3fff) << 24)
        | (mb as u64 & 0xff_ffff)
}

fn unsupported(d: DType) -> Error {
    Error::Check(format!(
        "pipeline: activations of dtype {d:?} cannot be sent (f32, bf16, f16)"
    ))
}

fn dtype_code(d: DType) -> Result<i64> {
    Ok(match d {
        DType::F32 => 0,
        DType::BF16 => 1,
        DType::F16 => 2,
        d => return Err(unsupported(d)),
    })
}

fn dtype_of(code: i64) -> Result<DType> {
    Ok(match code {
        0 => DType::F32,
        1 => DType::BF16,
        2 => DType::F16,
        c => {
            return Err(Error::Check(format!(
                "pipeline: bad dtype code {c} in a header"
            )))
        }
    })
}

/// Send `t` to group rank `dst`; `header` sends its shape first.
pub fn send_tensor(
    pg: &ProcessGroup,
    t: &Tensor,
    dst: usize,
    tag_data: u64,
    tag_header: Option<u64>,
) -> Result<()> {
    if let Some(th) = tag_header {
        send_header(pg, t, dst, th)?;
    }
    send_data(pg, &t.flatten_all()?, dst, tag_data)
}

/// Send `t`'s dtype and shape to group rank `dst`.
pub fn send_header(pg: &ProcessGroup, t: &Tensor, dst: usize, tag: u64) -> Result<()> {
    let dims = t.dims();
    if dims.len() > HEADER - 2 {
        return Err(Error::Check(format!(
            "pipeline: activation of rank {} (at most {})",
            dims.len(),
            HEADER - 2
        )));
    }
    let mut h = vec![0i64; HEADER];
    h[0] = dtype_code(t.dtype())?;
    h[1] = dims.len() as i64;
    for (i, d) in dims.iter().enumerate() {
        h[2 + i] = *d as i64;
    }
    pg.send(&h, dst, tag)?;
    Ok(())
}

/// Send the elements of `flat` (1-d) to group rank `dst`.
pub fn send_data(pg: &ProcessGroup, flat: &Tensor, dst: usize, tag: u64) -> Result<()> {
    match flat.dtype() {
        DType::F32 => pg.send(&flat.to_vec1::<f32>()?, dst, tag)?,
        DType::BF16 => pg.send(&flat.to_vec1::<bf16>()?, dst, tag)?,
        DType::F16 => pg.send(&flat.to_vec1::<f16>()?, dst, tag)?,
        d => return Err(unsupported(d)),
    }
    Ok(())
}

/// Post the receive of a header ([`send_header`]) from group rank `src`;
/// [`header_of`] reads it.
pub fn post_header(pg: &ProcessGroup, src: usize, tag: u64) -> Work<Vec<i64>> {
    pg.recv_async(vec![0i64; HEADER], src, tag)
}

/// The shape and dtype of the activation a posted header announces.
pub fn header_of(w: Work<Vec<i64>>) -> Result<(Shape, DType)> {
    decode_header(&w.wait()?)
}

/// The shape and dtype a header names, checked.
fn decode_header(h: &[i64]) -> Result<(Shape, DType)> {
    let nd = h[1];
    if !(0..=(HEADER - 2) as i64).contains(&nd) || h[2..2 + nd as usize].iter().any(|&d| d < 0) {
        return Err(Error::Check(format!("pipeline: bad header {h:?}")));
    }
    let dims: Vec<usize> = h[2..2 + nd as usize].iter().map(|&d| d as usize).collect();
    Ok((Shape::from(dims), dtype_of(h[0])?))
}

/// A receive in flight.
pub enum Pending {
    /// An activation: its header is on the way; the data follows it.
    Header {
        work: Work<Vec<i64>>,
        tag_data: u64,
        src: usize,
    },
    F32(Work<Vec<f32>>, Shape),
    BF16(Work<Vec<bf16>>, Shape),
    F16(Work<Vec<f16>>, Shape),
}

/// Post the receive of an activation (header, then data).
pub fn post_act(pg: &ProcessGroup, src: usize, tag_header: u64, tag_data: u64) -> Pending {
    Pending::Header {
        work: pg.recv_async(vec![0i64; HEADER], src, tag_header),
        tag_data,
        src,
    }
}

/// Post the receive of a tensor of known shape and dtype.
pub fn post_known(
    pg: &ProcessGroup,
    src: usize,
    tag_data: u64,
    shape: &Shape,
    dtype: DType,
) -> Result<Pending> {
    let n = shape.elem_count();
    let s = shape.clone();
    Ok(match dtype {
        DType::F32 => Pending::F32(pg.recv_async(vec![0f32; n], src, tag_data), s),
        DType::BF16 => Pending::BF16(pg.recv_async(vec![bf16::ZERO; n], src, tag_data), s),
        DType::F16 => Pending::F16(pg.recv_async(vec![f16::ZERO; n], src, tag_data), s),
        d => return Err(unsupported(d)),
    })
}

impl Pending {
    /// Wait for the tensor.
    pub fn wait(self, pg: &ProcessGroup, device: &Device) -> Result<Tensor> {
        Ok(match self {
            Pending::Header {
                work,
                tag_data,
                src,
            } => {
                let h = work.wait()?;
                let (shape, dtype) = decode_header(&h)?;
                let n = shape.elem_count();
                // The data follows its header on the same connection, so it is
                // already here or nearly: receive it directly.
                match dtype {
                    DType::F32 => {
                        let mut v = vec![0f32; n];
                        pg.recv(&mut v, src, tag_data)?;
                        Tensor::from_vec(v, shape, device)?
                    }
                    DType::BF16 => {
                        let mut v = vec![bf16::ZERO; n];
                        pg.recv(&mut v, src, tag_data)?;
                        Tensor::from_vec(v, shape, device)?
                    }
                    _ => {
                        let mut v = vec![f16::ZERO; n];
                        pg.recv(&mut v, src, tag_data)?;
                        Tensor::from_vec(v, shape, device)?
                    }
                }
            }
            Pending::F32(w, s) => Tensor::from_vec(w.wait()?, s, device)?,
            Pending::BF16(w, s) => Tensor::from_vec(w.wait()?, s, device)?,
            Pending::F16(w, s) => Tensor::from_vec(w.wait()?, s, device)?,
        })
    }
}
