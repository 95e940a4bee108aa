//! Storage the Python package adds to the engine's [`MatrixSource`]/[`MatrixSink`] seam: a numpy
//! buffer in memory read or written in place ([`BufferSource`], [`BufferSink`]), an array in GPU
//! memory read or written in place ([`DeviceSource`], [`DeviceSink`]), and a raw
//! row-major file region — an `np.memmap`'s file or a `.npy` body — read with `pread`
//! ([`RawFileSource`]). A `.npy` output file is the engine's own (`api::FileOutput`), as for
//! `run`: the same header numpy refuses until the last tile is written, and the same sidecar.
//!
//! Every matrix here is row-major with unit column stride and a row stride `ld` (elements) of
//! at least `cols`; the Python layer turns a Fortran-order array into its row-major transpose
//! and flips the operand's transpose flag, so column-major data is read in place too.

use std::fs::File;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

use mgmm_stream::backend::devmem;
use mgmm_stream::dtype::{self, DType};
use mgmm_stream::error::{Error, Result};
use mgmm_stream::store::par_crc32c;
use mgmm_stream::store::{Block, DeviceBlock, MatrixSink, MatrixSource, OutRect};
use rayon::prelude::*;

/// A row-major matrix in memory: base address, shape, row stride (elements), dtype.
#[derive(Clone, Copy, Debug)]
pub struct RawMatrix {
    pub addr: usize,
    pub rows: u64,
    pub cols: u64,
    pub ld: u64,
    pub dtype: DType,
}

impl RawMatrix {
    fn row_offset(&self, r: u64, c: u64) -> usize {
        ((r * self.ld + c) as usize) * self.dtype.size()
    }
    /// Bytes from the first element to the end of the last row.
    pub fn byte_len(&self) -> usize {
        if self.rows == 0 || self.cols == 0 {
            return 0;
        }
        self.row_offset(self.rows - 1, self.cols)
    }
}

fn check_block(label: &Path, shape: (u64, u64), b: &Block) -> Result<()> {
    b.check_inside(label, shape)
}

fn unsupported(label: &Path, from: DType, to: DType) -> Error {
    Error::format(label, format!("cannot convert {from} data to {to}"))
}

/// An array in memory read in place (a numpy buffer; the Python object is kept alive by the
/// caller for as long as the source exists).
pub struct BufferSource {
    pub label: PathBuf,
    pub m: RawMatrix,
}

// SAFETY: the buffer is only read, by any thread; the Python layer holds a reference to the
// array for the whole call and documents that arrays must not be resized or freed meanwhile
// (numpy refuses to resize an array whose buffer is referenced, and the GIL-holding caller is
// blocked in the call).
unsafe impl Send for BufferSource {}
unsafe impl Sync for BufferSource {}

impl BufferSource {
    fn row(&self, r: u64, c0: u64, cols: u64) -> &[u8] {
        let off = self.m.row_offset(r, c0);
        // SAFETY: r < rows and c0 + cols ≤ cols ≤ ld (checked by `check_block` and by the
        // Python layer when it built the descriptor from the array's shape and strides), so the
        // range lies inside the array's buffer, which outlives `self` (see above).
        unsafe {
            std::slice::from_raw_parts(
                (self.m.addr + off) as *const u8,
                cols as usize * self.m.dtype.size(),
            )
        }
    }
}

impl MatrixSource for BufferSource {
    fn path(&self) -> &Path {
        &self.label
    }
    fn is_file(&self) -> bool {
        false
    }
    fn shape(&self) -> (u64, u64) {
        (self.m.rows, self.m.cols)
    }
    fn dtype(&self) -> DType {
        self.m.dtype
    }
    fn read_block(&self, b: &Block, host: DType, dst: &mut [u8]) -> Result<()> {
        check_block(&self.label, self.shape(), b)?;
        let row_bytes = b.cols as usize * host.size();
        dst.par_chunks_mut(row_bytes)
            .enumerate()
            .try_for_each(|(i, d)| {
                let src = self.row(b.r0 + i as u64, b.c0, b.cols);
                if dtype::convert(self.m.dtype, src, host, d) {
                    Ok(())
                } else {
                    Err(unsupported(&self.label, self.m.dtype, host))
                }
            })
    }
    fn will_need(&self, _b: &Block) -> u64 {
        0
    }
    fn verify_block(&self, _b: &Block) -> Result<()> {
        Ok(())
    }
    /// The shape, dtype and a CRC-32C of the contents (one pass over the array, made only when
    /// a journal needs it), so a resumed call with changed data recomputes instead.
    fn identity(&self) -> String {
        let crcs: Vec<u32> = (0..self.m.rows)
            .into_par_iter()
            .map(|r| crc32c::crc32c(self.row(r, 0, self.m.cols)))
            .collect();
        let all: Vec<u8> = crcs.iter().flat_map(|c| c.to_le_bytes()).collect();
        format!(
            "array in memory {}×{} {}, contents crc32c {:#010x}",
            self.m.rows,
            self.m.cols,
            self.m.dtype,
            crc32c::crc32c(&all)
        )
    }
}

/// An array in memory written in place (the result array of `matmul`).
pub struct BufferSink {
    pub label: PathBuf,
    pub m: RawMatrix,
    /// Compute each block's CRC (only a journal needs it; memory outputs have none).
    pub checksums: bool,
    /// The array's memory is page-locked ([`mgmm_stream::backend::devmem::page_locked`]): a
    /// GPU's lanes download tiles straight into it ([`MatrixSink::direct_rect`]).
    pub page_locked: bool,
}

// SAFETY: as for `BufferSource`; writers write disjoint blocks (the MatrixSink contract), so
// no two threads write the same bytes.
unsafe impl Send for BufferSink {}
unsafe impl Sync for BufferSink {}

impl MatrixSink for BufferSink {
    fn path(&self) -> &Path {
        &self.label
    }
    fn shape(&self) -> (u64, u64) {
        (self.m.rows, self.m.cols)
    }
    fn dtype(&self) -> DType {
        self.m.dtype
    }
    fn storage_tile(&self) -> (u64, u64) {
        (self.m.rows, self.m.cols)
    }
    fn write_block(&self, b: &Block, host: DType, src: &[u8]) -> Result<u32> {
        check_block(&self.label, self.shape(), b)?;
        if host != self.m.dtype {
            return Err(unsupported(&self.label, host, self.m.dtype));
        }
        let row_bytes = b.cols as usize * host.size();
        src.par_chunks(row_bytes).enumerate().for_each(|(i, s)| {
            let off = self.m.row_offset(b.r0 + i as u64, b.c0);
            // SAFETY: the row lies inside the array (checked above and by the Python layer),
            // the array is writable and outlives the sink, and concurrent calls write disjoint
            // blocks, so this row range is written by this thread alone.
            unsafe {
                std::ptr::copy_nonoverlapping(s.as_ptr(), (self.m.addr + off) as *mut u8, s.len());
            }
        });
        Ok(if self.checksums { par_crc32c(src) } else { 0 })
    }
    /// Every block of the array, as it lies in memory, where no conversion is needed: the
    /// lanes then write the array themselves (the CPU's any memory, a GPU's when it is
    /// page-locked) and the copy out of an output buffer is saved.
    fn direct_rect(&self, b: &Block, host: DType) -> Option<OutRect> {
        if host != self.m.dtype || check_block(&self.label, self.shape(), b).is_err() {
            return None;
        }
        let es = host.size();
        // SAFETY: the block lies inside the array (checked above; ld ≥ cols by the Python
        // layer), which is writable, outlives the call, and is written by nothing else while
        // it runs (the Python layer refuses an `out` that overlaps an input); `page_locked`
        // is what the driver said of this very memory.
        Some(unsafe {
            OutRect::new(
                (self.m.addr + self.m.row_offset(b.r0, b.c0)) as u64,
                self.m.ld as usize * es,
                b.cols as usize * es,
                b.rows as usize,
                self.page_locked,
                None,
            )
        })
    }
    fn wrote_in_place(&self, b: &Block) -> Result<u32> {
        if !self.checksums {
            return Ok(0);
        }
        let r = self
            .direct_rect(b, self.m.dtype)
            .ok_or_else(|| Error::Usage("a block outside the array was written (a bug)".into()))?;
        // SAFETY: the block's rows in the array, which outlives the sink; the lane's copy into
        // them is done and no one else writes them.
        Ok(unsafe { r.rows() }.fold(0, crc32c::crc32c_append))
    }
    fn prefault(&self, _b: &Block) -> u64 {
        0
    }
    fn flush_block(&self, _b: &Block) -> Result<()> {
        Ok(())
    }
    fn forget_checksums(&self) {}
    fn finish(self: Box<Self>, _durable: bool) -> Result<()> {
        Ok(())
    }
}

/// A row-major matrix stored in a file at `offset` (an `np.memmap`'s region, a `.npy` body),
/// read with `pread` — never through Python.
pub struct RawFileSource {
    pub path: PathBuf,
    file: File,
    offset: u64,
    rows: u64,
    cols: u64,
    ld: u64,
    dtype: DType,
}

impl RawFileSource {
    pub fn open(
        path: &Path,
        offset: u64,
        (rows, cols, ld): (u64, u64, u64),
        dtype: DType,
    ) -> Result<RawFileSource> {
        let file = File::open(path).map_err(|e| Error::io(path, "cannot open", e))?;
        let len = file
            .metadata()
            .map_err(|e| Error::io(path, "cannot stat", e))?
            .len();
        let need = offset + ((rows - 1) * ld + cols) * dtype.size() as u64;
        if len < need {
            return Err(Error::format(
                path,
                format!("is {len} bytes, but a {rows}×{cols} {dtype} matrix at offset {offset} needs {need}; is the file truncated?"),
            ));
        }
        Ok(RawFileSource {
            path: path.to_path_buf(),
            file,
            offset,
            rows,
            cols,
            ld,
            dtype,
        })
    }
    fn pos(&self, r: u64, c: u64) -> u64 {
        self.offset + (r * self.ld + c) * self.dtype.size() as u64
    }
}

impl MatrixSource for RawFileSource {
    fn path(&self) -> &Path {
        &self.path
    }
    fn shape(&self) -> (u64, u64) {
        (self.rows, self.cols)
    }
    fn dtype(&self) -> DType {
        self.dtype
    }
    fn read_block(&self, b: &Block, host: DType, dst: &mut [u8]) -> Result<()> {
        check_block(&self.path, self.shape(), b)?;
        let es = self.dtype.size();
        let row_bytes = b.cols as usize * host.size();
        dst.par_chunks_mut(row_bytes)
            .enumerate()
            .try_for_each_init(Vec::new, |tmp, (i, d)| {
                let at = self.pos(b.r0 + i as u64, b.c0);
                let read = |buf: &mut [u8]| {
                    self.file
                        .read_exact_at(buf, at)
                        .map_err(|e| Error::io(&self.path, "cannot read", e))
                };
                if host == self.dtype {
                    return read(d);
                }
                tmp.resize(b.cols as usize * es, 0u8);
                read(tmp)?;
                if dtype::convert(self.dtype, tmp, host, d) {
                    Ok(())
                } else {
                    Err(unsupported(&self.path, self.dtype, host))
                }
            })
    }
    fn will_need(&self, b: &Block) -> u64 {
        let start = self.pos(b.r0, b.c0);
        let end = self.pos(b.r0 + b.rows - 1, b.c0 + b.cols);
        // SAFETY: posix_fadvise only reads its integer arguments; the descriptor is open.
        let r = unsafe {
            libc::posix_fadvise(
                self.file.as_raw_fd(),
                start as libc::off_t,
                (end - start) as libc::off_t,
                libc::POSIX_FADV_WILLNEED,
            )
        };
        if r == 0 {
            end - start
        } else {
            0
        }
    }
    fn verify_block(&self, _b: &Block) -> Result<()> {
        Ok(())
    }
    fn identity(&self) -> String {
        let (len, mtime) = self
            .file
            .metadata()
            .map(|m| {
                (
                    m.len(),
                    m.mtime_nsec() as i128 + m.mtime() as i128 * 1_000_000_000,
                )
            })
            .unwrap_or((0, 0));
        format!(
            "raw {} at offset {}: {}×{} {} (row stride {}), file {len} bytes modified {mtime} ns",
            self.path.display(),
            self.offset,
            self.rows,
            self.cols,
            self.dtype,
            self.ld
        )
    }
}

/// A row-major matrix in GPU memory (a CUDA torch tensor, a CuPy array): address (unified),
/// shape, row stride (elements), dtype, and the GPU that holds it.
#[derive(Clone, Copy, Debug)]
pub struct DeviceMatrix {
    pub m: RawMatrix,
    pub device: usize,
}

impl DeviceMatrix {
    /// Block `b` as a rectangle of this array's memory.
    fn rect(&self, b: &Block) -> (u64, usize, usize) {
        let es = self.m.dtype.size();
        let addr = self.m.addr as u64 + ((b.r0 * self.m.ld + b.c0) as usize * es) as u64;
        (addr, self.m.ld as usize * es, b.cols as usize * es)
    }
}

/// An array in GPU memory read in place: a GPU lane copies its blocks device to device
/// ([`MatrixSource::device_block`]); anything else (a CPU lane, another dtype, `verify`) reads
/// them through the host with a synchronous copy.
pub struct DeviceSource {
    pub label: PathBuf,
    pub d: DeviceMatrix,
}

// SAFETY: the memory is only read (by the GPUs, or copied to the host by the driver); the
// Python layer holds a reference to the array for the whole call and waited for the caller's
// stream before it began.
unsafe impl Send for DeviceSource {}
unsafe impl Sync for DeviceSource {}

impl MatrixSource for DeviceSource {
    fn is_file(&self) -> bool {
        false
    }
    fn path(&self) -> &Path {
        &self.label
    }
    fn shape(&self) -> (u64, u64) {
        (self.d.m.rows, self.d.m.cols)
    }
    fn dtype(&self) -> DType {
        self.d.m.dtype
    }
    fn read_block(&self, b: &Block, host: DType, dst: &mut [u8]) -> Result<()> {
        check_block(&self.label, self.shape(), b)?;
        let (addr, pitch, row_len) = self.d.rect(b);
        let rows = b.rows as usize;
        let same = host == self.d.m.dtype;
        let mut tmp = if same {
            Vec::new()
        } else {
            vec![0u8; rows * row_len]
        };
        let to: &mut [u8] = if same {
            &mut dst[..rows * row_len]
        } else {
            &mut tmp
        };
        // SAFETY: the rectangle lies inside the array (checked by `check_block` and by the
        // Python layer from the array's shape and strides), alive for the call; `to` holds
        // `rows` dense rows of `row_len` bytes.
        unsafe {
            devmem::copy_2d(
                self.d.device,
                devmem::Side {
                    addr,
                    pitch,
                    on_gpu: true,
                },
                devmem::Side {
                    addr: to.as_mut_ptr() as u64,
                    pitch: row_len,
                    on_gpu: false,
                },
                row_len,
                rows,
            )?;
        }
        if !same && !dtype::convert(self.d.m.dtype, &tmp, host, dst) {
            return Err(unsupported(&self.label, self.d.m.dtype, host));
        }
        Ok(())
    }
    fn device_block(&self, b: &Block, host: DType) -> Option<DeviceBlock> {
        if host != self.d.m.dtype || b.check_inside(&self.label, self.shape()).is_err() {
            return None;
        }
        let (addr, pitch, row_len) = self.d.rect(b);
        Some(DeviceBlock {
            addr,
            pitch,
            row_len,
            rows: b.rows as usize,
            device: self.d.device,
        })
    }
    fn will_need(&self, _b: &Block) -> u64 {
        0
    }
    fn verify_block(&self, _b: &Block) -> Result<()> {
        Ok(())
    }
    /// Only the shape, dtype and address: a GPU array is never resumed (its result is never a
    /// journaled file: the Python layer refuses that pairing) and reading it all to hash it
    /// would cost a copy through the host.
    fn identity(&self) -> String {
        format!(
            "array on GPU {} at {:#x}: {}×{} {}",
            self.d.device, self.d.m.addr, self.d.m.rows, self.d.m.cols, self.d.m.dtype
        )
    }
}

/// An array in GPU memory written in place (`out=` a CUDA tensor or CuPy array): a lane on its
/// GPU copies each finished tile into it device to device ([`MatrixSink::direct_rect`]);
/// anything else (a lane on another GPU, the CPU, another dtype) hands blocks to
/// [`MatrixSink::write_block`], which copies them up from the host.
pub struct DeviceSink {
    pub label: PathBuf,
    pub d: DeviceMatrix,
}

// SAFETY: as for `DeviceSource`; writers write disjoint blocks (the MatrixSink contract).
unsafe impl Send for DeviceSink {}
unsafe impl Sync for DeviceSink {}

impl MatrixSink for DeviceSink {
    fn path(&self) -> &Path {
        &self.label
    }
    fn shape(&self) -> (u64, u64) {
        (self.d.m.rows, self.d.m.cols)
    }
    fn dtype(&self) -> DType {
        self.d.m.dtype
    }
    fn storage_tile(&self) -> (u64, u64) {
        (self.d.m.rows, self.d.m.cols)
    }
    fn write_block(&self, b: &Block, host: DType, src: &[u8]) -> Result<u32> {
        check_block(&self.label, self.shape(), b)?;
        if host != self.d.m.dtype {
            return Err(unsupported(&self.label, host, self.d.m.dtype));
        }
        let (addr, pitch, row_len) = self.d.rect(b);
        // SAFETY: the rectangle lies inside the array (checked above and by the Python layer),
        // writable and alive for the call; concurrent calls write disjoint blocks; `src` holds
        // the block's dense rows.
        unsafe {
            devmem::copy_2d(
                self.d.device,
                devmem::Side {
                    addr: src.as_ptr() as u64,
                    pitch: row_len,
                    on_gpu: false,
                },
                devmem::Side {
                    addr,
                    pitch,
                    on_gpu: true,
                },
                row_len,
                b.rows as usize,
            )?;
        }
        Ok(0)
    }
    /// Every block, where no conversion is needed: a GPU's lanes copy tiles into the array
    /// device to device instead of through the host twice (lanes on that GPU only).
    fn direct_rect(&self, b: &Block, host: DType) -> Option<OutRect> {
        if host != self.d.m.dtype || check_block(&self.label, self.shape(), b).is_err() {
            return None;
        }
        let (addr, pitch, row_len) = self.d.rect(b);
        // SAFETY: as for `BufferSink::direct_rect`, in the memory of GPU `device`, which holds
        // the array (asked of the driver when the descriptor was made). Only lanes on that GPU
        // take it (`pipeline`'s lane wiring): another GPU may not have it mapped.
        Some(unsafe {
            OutRect::new(
                addr,
                pitch,
                row_len,
                b.rows as usize,
                false,
                Some(self.d.device),
            )
        })
    }
    /// No checksum: a GPU array is never journaled.
    fn wrote_in_place(&self, _b: &Block) -> Result<u32> {
        Ok(0)
    }
    fn prefault(&self, _b: &Block) -> u64 {
        0
    }
    fn flush_block(&self, _b: &Block) -> Result<()> {
        Ok(())
    }
    fn forget_checksums(&self) {}
    /// Every block has landed in the array when this returns.
    fn finish(self: Box<Self>, _durable: bool) -> Result<()> {
        devmem::finish(self.d.device)
    }
}
