/* The MPI peer of `phalanx bench collectives --op all_reduce`: the same
 * sweep with MPI_Allreduce (f32, sum) on the system MPI, printed in the same
 * table (time = the slowest rank's mean over the iterations).
 *
 *   mpicc -O2 -o /tmp/mpi_allreduce bench/peers/mpi_allreduce.c
 *   mpirun -np 2 /tmp/mpi_allreduce 8 65536 1048576 16777216 67108864
 *
 * Arguments: sizes in bytes. Iterations: 20 (5 warm-up), fewer above 16 MB,
 * as Phalanx's bench does.
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, n;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    if (rank == 0) {
        printf("# MPI_Allreduce f32 sum, %d ranks\n", n);
        printf("# %-14s %10s %10s %12s %12s\n", "size(B)", "count", "time(us)", "algbw(GB/s)",
               "busbw(GB/s)");
    }
    for (int a = 1; a < argc; a++) {
        long bytes = atol(argv[a]);
        int count = (int)(bytes / 4);
        int iters = bytes > (16L << 20) ? 5 : 20, warm = bytes > (16L << 20) ? 1 : 5;
        float *x = malloc((size_t)count * 4), *y = malloc((size_t)count * 4);
        for (int i = 0; i < count; i++) x[i] = (float)((rank + i) % 7);
        for (int i = 0; i < warm; i++)
            MPI_Allreduce(x, y, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        MPI_Barrier(MPI_COMM_WORLD);
        double t = MPI_Wtime();
        for (int i = 0; i < iters; i++)
            MPI_Allreduce(x, y, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        t = (MPI_Wtime() - t) / iters;
        double slowest;
        MPI_Reduce(&t, &slowest, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
        if (rank == 0) {
            double alg = bytes / slowest / 1e9;
            printf("  %-14ld %10d %10.1f %12.3f %12.3f\n", bytes, count, slowest * 1e6, alg,
                   alg * 2.0 * (n - 1) / n);
        }
        free(x);
        free(y);
    }
    MPI_Finalize();
    return 0;
}
